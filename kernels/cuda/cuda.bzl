"""cuda_object: compiles one .cu file with the toolkit's nvcc into a PIC object.

A genrule cannot see headers of other packages' cc_library targets without exports_files(); this
rule takes them through CcInfo instead, so every header the .cu includes is a declared input.
Without a CUDA toolkit at build time (third_party/cuda_configure.bzl) the target is incompatible,
so wildcard builds skip it and everything that links it.
"""

load("@cuda//:defs.bzl", "NVCC", "cuda_only")

def _cuda_object_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".pic.o")
    transitive = []
    includes = []
    for dep in ctx.attr.deps:
        cc = dep[CcInfo].compilation_context
        transitive.append(cc.headers)
        for p in cc.includes.to_list() + cc.quote_includes.to_list() + cc.system_includes.to_list():
            if p not in includes:
                includes.append(p)
    args = ctx.actions.args()
    args.add_all(ctx.attr.nvcc_flags)
    args.add("-I.")
    args.add("-I" + ctx.genfiles_dir.path)
    for p in includes:
        args.add("-I" + p)
    args.add(ctx.file.src.path)
    args.add("-o", out.path)
    ctx.actions.run(
        executable = ctx.attr.nvcc,
        arguments = [args],
        inputs = depset([ctx.file.src] + ctx.files.hdrs, transitive = transitive),
        outputs = [out],
        mnemonic = "Nvcc",
        progress_message = "nvcc %s" % ctx.file.src.short_path,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([out]))]

_cuda_object = rule(
    implementation = _cuda_object_impl,
    attrs = {
        "src": attr.label(allow_single_file = [".cu"], mandatory = True),
        "hdrs": attr.label_list(allow_files = [".h", ".cuh"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "nvcc_flags": attr.string_list(),
        "nvcc": attr.string(default = NVCC),
    },
)

# nvcc flags of every CUDA object of the project: Hopper (H100/H200) machine code, the
# wgmma-capable target, plus PTX that newer GPUs JIT-compile.
NVCC_FLAGS = [
    "-c",
    "-O3",
    "-Xcompiler",
    "-fPIC",
    "-std=c++17",
    "-gencode",
    "arch=compute_90a,code=sm_90a",  # Hopper (H100/H200) machine code, wgmma-capable target
    "-gencode",
    "arch=compute_90,code=compute_90",  # PTX, JIT-compiled on newer GPUs
]

def cuda_object(name, **kwargs):
    _cuda_object(name = name, target_compatible_with = cuda_only(), **kwargs)
