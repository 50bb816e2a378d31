#!/usr/bin/env bash
# The CUDA path's lints on a machine without a GPU (CI, after scripts/gpu-bundle.sh): clippy over every
# target with `--features cuda,mpi`, warnings as errors. It uses the bundle's target directory and profile
# ($NANODIST_CUDA_TARGET_DIR, default outside the clone and reused between runs where the machine keeps it;
# $NANODIST_BUNDLE_PROFILE, default release), so candle's CUDA kernels, which nvcc compiled for the bundle,
# are not compiled again.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda/env.sh
nvcc --version | tail -1
export CARGO_TARGET_DIR="${NANODIST_CUDA_TARGET_DIR:-$HOME/.cache/nanodist/cuda-target}"
cargo clippy --profile "${NANODIST_BUNDLE_PROFILE:-release}" --locked --all-targets --features cuda,mpi -- -D warnings
