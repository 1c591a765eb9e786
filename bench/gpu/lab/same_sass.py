#!/usr/bin/env python3
"""Whether a change moved the machine code of the CUDA kernels, without a GPU.

For each .cu file given, compiles it at a base revision and in the working tree with nvcc for
sm_90a (the H200's), then compares every kernel's code section (.text.<kernel>) of the two
cubins byte for byte and prints ptxas' registers and spills for both. A refactor that leaves
every kernel's bytes the same cannot change its speed or its results, so it needs no device run;
one that changes them needs the before/after run of product_compare.sh.

  bench/gpu/lab/same_sass.py [--base REV] [--arch sm_90a] kernels/cuda/dca_decode.cu ...

A source may name a file that the change split: OLD=NEW1+NEW2+... compiles OLD at the base and the
NEW files in the working tree, and compares the union of their kernels (each kernel in one of
them), e.g. kernels/cuda/dca_cuda.cu=kernels/cuda/dca_prefill.cu+kernels/cuda/dca_decode.cu.

REV defaults to HEAD (so: what the uncommitted change does). Exit status 0 when every kernel of
every file is the same, 1 when some differ, 2 on a usage or build error. Needs nvcc (the CUDA
toolkit) and git; the base tree is checked out in a temporary worktree.
"""
import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile


def sections(cubin):
    """The named sections of an ELF64 little-endian file (a cubin), as {name: bytes}."""
    with open(cubin, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{cubin}: not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name, kind, _flags, _addr, offset, size in headers:
        start = names_at + name
        label = data[start:data.index(b"\0", start)].decode()
        out[label] = b"" if kind == 8 else data[offset:offset + size]  # 8: SHT_NOBITS
    return out


USAGE = re.compile(r"Compiling entry function '(\S+)'|(\d+) bytes spill stores|Used (\d+) registers")


def compile_cu(tree, source, arch, cubin):
    """nvcc -cubin of tree/source; returns {kernel: (registers, spill store bytes)}."""
    cmd = ["nvcc", "-cubin", "-O3", "-std=c++17", f"-arch={arch}", "-Xptxas", "-v", "-I", tree,
           "-o", cubin, os.path.join(tree, source)]
    run = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        raise RuntimeError(f"nvcc failed on {source} in {tree}")
    usage, kernel = {}, None
    for line in run.stderr.splitlines():
        for m in USAGE.finditer(line):
            if m.group(1):
                kernel = m.group(1)
                usage[kernel] = [None, 0]
            elif m.group(2) and kernel:
                usage[kernel][1] = int(m.group(2))
            elif m.group(3) and kernel:
                usage[kernel][0] = int(m.group(3))
    return usage


def stable_name(name):
    """A kernel's name without the hash that nvcc puts in the names of anonymous namespaces, which
    depends on the file's path: the base tree and the working tree would otherwise never match."""
    return re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N__", name)


def compile_all(tree, sources, arch, tmp):
    """compile_cu of each source; the union of their usage and of their kernels' sections (a kernel
    in two of them is a ValueError: one file each), by stable_name."""
    usage, text = {}, {}
    for i, source in enumerate(sources):
        cubin = os.path.join(tmp, f"{os.path.basename(tree)}_{i}.cubin")
        usage.update({stable_name(k): v for k, v in compile_cu(tree, source, arch, cubin).items()})
        for name, data in sections(cubin).items():
            if not name.startswith(".text."):
                continue
            name = stable_name(name)
            if name in text:
                raise ValueError(f"{name[len('.text.'):]} is in more than one of {sources}")
            text[name] = data
    return usage, text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the revision to compare against")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("sources", nargs="+", help=".cu files, relative to the repository root")
    args = parser.parse_args()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "--quiet", base_tree,
                        args.base], check=True)
        try:
            for source in args.sources:
                old, _, new = source.partition("=")
                use_before, a = compile_all(base_tree, [old], args.arch, tmp)
                use_after, b = compile_all(root, new.split("+") if new else [old], args.arch, tmp)
                kernels = sorted(n for n in set(a) | set(b) if n.startswith(".text."))
                print(f"{source} ({args.base} -> working tree, {args.arch}): {len(kernels)} kernels")
                for name in kernels:
                    kernel = name[len(".text."):]
                    x, y = a.get(name), b.get(name)
                    same = x == y
                    differ |= not same
                    ra, sa = use_before.get(kernel, [None, None])
                    rb, sb = use_after.get(kernel, [None, None])
                    size = lambda s: "-" if s is None else str(len(s))
                    print(f"  {'same' if same else 'DIFF'}  bytes {size(x)} -> {size(y)}  "
                          f"regs {ra} -> {rb}  spill stores {sa} -> {sb}  {kernel}")
        finally:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", base_tree],
                           check=False)
    print("every kernel's code is the same" if not differ else "some kernels' code differs")
    return 1 if differ else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, ValueError, subprocess.CalledProcessError, FileNotFoundError) as e:
        sys.stderr.write(f"same_sass: {e}\n")
        sys.exit(2)
