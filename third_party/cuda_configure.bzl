"""cuda_configure: the @cuda repository, with or without a CUDA toolkit.

Looks for bin/nvcc under $CUDA_PATH (default /usr/local/cuda). When it is there, @cuda holds the
toolkit's include/, lib64/ and bin/ (symlinks) with the targets of third_party/cuda.BUILD, and
@cuda//:defs.bzl says CUDA_AVAILABLE = True. When it is not, or when ATTND_CUDA=0 hides it, @cuda
holds empty stand-ins and CUDA_AVAILABLE = False: the CUDA targets are then incompatible with the
host (cuda_only()), so `bazel build //...` and `bazel test //...` skip them, and //server/engine:cuda_engine
builds a stub that fails --device=cuda with a clear message (docs/BUILD.md, "With or without CUDA").

The rule runs again when ATTND_CUDA or CUDA_PATH change, and on `bazel sync --configure`; a toolkit
installed or removed behind Bazel's back needs one of those (or `bazel clean --expunge`).
"""

_DEFS = '''"""Written by third_party/cuda_configure.bzl: {summary}."""

CUDA_AVAILABLE = {available}

# Where nvcc was found ("" without a toolkit).
NVCC = "{nvcc}"

# One line for the build scripts: which engines this build contains.
BACKENDS = "{summary}"

def if_cuda(with_cuda, without_cuda = []):
    """with_cuda when a toolkit was found at build time, else without_cuda."""
    return with_cuda if CUDA_AVAILABLE else without_cuda

def cuda_only():
    """target_compatible_with for targets that need the toolkit: incompatible without one."""
    return [] if CUDA_AVAILABLE else ["@cuda//:toolkit_present"]
'''

# Both variants declare this constraint; no platform carries its value, so a target that requires
# it (cuda_only() without a toolkit) is incompatible and skipped by wildcard builds and tests.
_CONSTRAINT = '''
constraint_setting(name = "toolkit")

constraint_value(
    name = "toolkit_present",
    constraint_setting = ":toolkit",
)
'''

_STUB_BUILD = '''# No CUDA toolkit at build time (third_party/cuda_configure.bzl): empty stand-ins, so BUILD files
# can name these labels; everything that really needs them is cuda_only() and skipped.

package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cudart_headers",
    target_compatible_with = [":toolkit_present"],
)

cc_library(
    name = "cudart_static",
    target_compatible_with = [":toolkit_present"],
)

filegroup(name = "nvcc")
'''

def _cuda_configure_impl(ctx):
    hidden = ctx.os.environ.get("ATTND_CUDA", "") == "0"
    root = ctx.os.environ.get("CUDA_PATH", "") or "/usr/local/cuda"
    nvcc = ctx.path(root + "/bin/nvcc")
    if not hidden and nvcc.exists:
        for d in ["include", "lib64", "bin"]:
            ctx.symlink(root + "/" + d, d)
        ctx.file("BUILD", ctx.read(ctx.path(ctx.attr.build_file)) + _CONSTRAINT)
        summary = "attnd backends: cpu + cuda (CUDA toolkit at %s)" % root
        ctx.file("defs.bzl", _DEFS.format(available = "True", nvcc = str(nvcc), summary = summary))
    else:
        why = "ATTND_CUDA=0" if hidden else "no nvcc at %s/bin" % root
        ctx.file("BUILD", _STUB_BUILD + _CONSTRAINT)
        summary = "attnd backends: cpu only (no CUDA toolkit: %s)" % why
        ctx.file("defs.bzl", _DEFS.format(available = "False", nvcc = "", summary = summary))
    ctx.file("BACKENDS", summary + "\n")

    # Shown (as a DEBUG line) by the build that configures @cuda: a fresh clone's first build, and
    # again whenever ATTND_CUDA or CUDA_PATH change. script/server and script/test print BACKENDS.
    print(summary)

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    attrs = {"build_file": attr.label(allow_single_file = True, mandatory = True)},
    environ = ["ATTND_CUDA", "CUDA_PATH"],
    configure = True,
    local = True,
)
