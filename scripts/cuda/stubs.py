#!/usr/bin/env python3
"""Link-time stand-ins for the CUDA libraries that a `--features cuda` executable links, for machines without
them (CI and the CPU build machine: PyPI's CUDA wheels carry no libcuda and no unversioned names).

    python3 scripts/cuda/stubs.py OUT_DIR --cudart PATH/libcudart.so.13

candle and cudarc link the driver, cuBLAS, cuBLASLt, cuRAND, NVRTC and NCCL dynamically (cudarc's
`dynamic-linking`), and candle-kernels links the CUDA runtime. For each library this writes `lib<name>.so`
with the real library's SONAME (so the executable's NEEDED entries name what the GPU machine has) that
defines every function cudarc's bindings for it declare, plus a link named by the SONAME. The runtime is
real (it ships in the nvcc wheels): `libcudart.so` is a link to it. Put OUT_DIR on LIBRARY_PATH while
linking; on the GPU machine the real libraries are found on LD_LIBRARY_PATH (the bundle's self-test sets
it). The stand-ins are unversioned: an unversioned reference binds to the real library's default version.

Every stand-in function returns 100, which is the driver's CUDA_ERROR_NO_DEVICE (and an error code of the
other libraries), so that a CUDA executable with OUT_DIR on LD_LIBRARY_PATH runs its CPU paths and finds no
GPU: scripts/gpu/check-bundle.py runs the bundle's binary that way.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# library name for `-l`, SONAME of the real library on CUDA 13, cudarc's sys modules that declare it.
LIBS = [
    ("cuda", "libcuda.so.1", ["driver"]),
    ("nccl", "libnccl.so.2", ["nccl"]),
    ("nvrtc", "libnvrtc.so.13", ["nvrtc"]),
    ("curand", "libcurand.so.10", ["curand"]),
    ("cublas", "libcublas.so.13", ["cublas"]),
    ("cublasLt", "libcublasLt.so.13", ["cublaslt"]),
]


def cudarc_src(root):
    """The source folder of the cudarc crate that Cargo.lock resolves."""
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--features", "cuda", "--locked"],
                          cwd=root, check=True, capture_output=True, text=True).stdout
    paths = [p["manifest_path"] for p in json.loads(meta)["packages"] if p["name"] == "cudarc"]
    if len(paths) != 1:
        sys.exit(f"expected one cudarc package in Cargo.lock, found {paths}")
    return os.path.join(os.path.dirname(paths[0]), "src")


def functions(src, modules):
    names = set()
    for m in modules:
        text = open(os.path.join(src, m, "sys", "mod.rs")).read()
        names.update(re.findall(r"^pub unsafe fn (\w+)\(", text, re.M))
    if not names:
        sys.exit(f"no functions found in cudarc's {modules} bindings under {src}")
    return sorted(names)


def relink(link, target):
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(target, link)


def build(out, name, soname, names):
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as c:
        c.write("/* Link-time stand-in: the real library is loaded at run time. 100: CUDA_ERROR_NO_DEVICE. */\n")
        for n in names:
            c.write(f"int {n}(void) {{ return 100; }}\n")
    lib = os.path.join(out, f"lib{name}.so")
    subprocess.run(["cc", "-shared", "-fPIC", "-O0", f"-Wl,-soname,{soname}", "-o", lib, c.name], check=True)
    os.unlink(c.name)
    relink(os.path.join(out, soname), os.path.basename(lib))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--cudart", required=True, help="the real libcudart.so.13")
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(a.out, exist_ok=True)
    src = cudarc_src(root)
    for name, soname, modules in LIBS:
        names = functions(src, modules)
        build(a.out, name, soname, names)
        print(f"lib{name}.so: stand-in for {soname}, {len(names)} functions")
    for name in ("libcudart.so", os.path.basename(a.cudart)):
        relink(os.path.join(a.out, name), os.path.abspath(a.cudart))
    print(f"libcudart.so -> {os.path.abspath(a.cudart)}")


if __name__ == "__main__":
    main()
