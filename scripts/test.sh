#!/usr/bin/env bash
# The tests in one command: installs what they need (scripts/setup.sh: Open MPI, Slurm with a single-node
# cluster on localhost, the Python readers, the corpus), then runs `cargo test --locked --features mpi`
# (extra arguments go to it). What setup.sh installed must then run, not skip: Slurm, Python and a C++
# compiler always, the netlab where this runs as root (it needs network namespaces). CI runs exactly this
# (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export NANODIST_CORPUS="$PWD/data/corpus/shakespeare"
export NANODIST_REQUIRE_SLURM="${NANODIST_REQUIRE_SLURM:-1}"
export NANODIST_REQUIRE_PYTHON="${NANODIST_REQUIRE_PYTHON:-1}"
# Every CUDA kernel is also compiled for the host and run against its twin, with the C++ compiler there
# (g++, or the clang that setup.sh installs).
export NANODIST_REQUIRE_CXX="${NANODIST_REQUIRE_CXX:-1}"
if [ "$(id -u)" = 0 ]; then
    export NANODIST_REQUIRE_NETLAB="${NANODIST_REQUIRE_NETLAB:-1}"
fi
cargo test --locked --features mpi "$@"
