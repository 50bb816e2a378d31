#!/usr/bin/env bash
# The CUDA path on a machine without a GPU (CI): nvcc 13.4.92 from PyPI; every kernel compiled to PTX for
# sm_80 (A100) and sm_90 (H100) and assembled by ptxas (which rejects invalid PTX); then
# `cargo check --all-targets --features cuda,mpi` (candle's CUDA kernels included). The target directory
# lives outside the clone and is reused between runs when the machine keeps it ($NANODIST_CUDA_TARGET_DIR).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda/env.sh
nvcc --version | tail -1
out=$(mktemp -d)
for cu in kernels/*.cu; do
    for sm in 80 90; do
        ptx="$out/$(basename "$cu" .cu).sm_$sm.ptx"
        nvcc -ptx -fmad=false -arch=sm_$sm -o "$ptx" "$cu"
        ptxas -arch=sm_$sm -o "$out/kernel.cubin" "$ptx"
        echo "$cu -> PTX for sm_$sm: $(grep -c '^.visible .entry' "$ptx") kernels, assembled by ptxas"
    done
done
export CARGO_TARGET_DIR="${NANODIST_CUDA_TARGET_DIR:-$HOME/.cache/nanodist/cuda-target}"
cargo check --locked --all-targets --features cuda,mpi
