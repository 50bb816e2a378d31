#!/usr/bin/env bash
# OpenWebText as the seed configs expect it (config/gpt2-small.toml, config/decent-gpt2-small.toml read
# data/openwebtext/): the dataset's parquet shards from the Hugging Face Hub, tokenized with GPT-2's BPE by
# `nanodist prepare` into nanoGPT's train.bin / val.bin (and Megatron's .bin/.idx with --format both).
#
#   scripts/data/openwebtext.sh [--shards N] [--from DIR] [--output DIR] [--val-fraction F] [--format F]
#
# --shards N   download only the first N shards (about 80 MB of text each), e.g. for a quick look;
# --from DIR   skip the download and prepare the parquet shards already in DIR (any layout, searched
#              recursively);
# The download needs the Hugging Face CLI (pip install -U huggingface_hub) and network access to the Hub;
# the repository, revision and file pattern can be changed with OWT_REPO, OWT_REVISION and OWT_INCLUDE
# (default: Skylion007/openwebtext's parquet conversion). NANODIST picks the binary (default
# ./target/release/nanodist). nanoGPT holds out 0.05% of the documents for validation; so does this.
set -euo pipefail
cd "$(dirname "$0")/../.."

shards="" from="" out=data/openwebtext val=0.0005 format=nanogpt
while [ $# -gt 0 ]; do
    case "$1" in
        --shards) shards=$2; shift 2 ;;
        --from) from=$2; shift 2 ;;
        --output) out=$2; shift 2 ;;
        --val-fraction) val=$2; shift 2 ;;
        --format) format=$2; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "openwebtext.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
nanodist=${NANODIST:-./target/release/nanodist}
if [ ! -x "$nanodist" ]; then
    echo "openwebtext.sh: $nanodist not found; build it (cargo build --release) or set NANODIST" >&2
    exit 2
fi

if [ -z "$from" ]; then
    if command -v hf >/dev/null; then
        hub=(hf download)
    elif command -v huggingface-cli >/dev/null; then
        hub=(huggingface-cli download)
    else
        echo "openwebtext.sh: the download needs the Hugging Face CLI: pip install -U huggingface_hub" \
             "(or give --from DIR with the parquet shards)" >&2
        exit 2
    fi
    repo=${OWT_REPO:-Skylion007/openwebtext}
    revision=${OWT_REVISION:-refs/convert/parquet}
    pattern=${OWT_INCLUDE:-plain_text/train/*.parquet}
    from=data/openwebtext-parquet
    include=("$pattern")
    if [ -n "$shards" ]; then
        # The shards are numbered 0000.parquet, 0001.parquet, ... in the conversion.
        include=()
        for ((i = 0; i < shards; i++)); do include+=("${pattern%\*.parquet}$(printf %04d "$i").parquet"); done
    fi
    "${hub[@]}" "$repo" --repo-type dataset --revision "$revision" --include "${include[@]}" --local-dir "$from"
fi

"$nanodist" prepare --input "$from" --output "$out" --tokenizer gpt2 --val-fraction "$val" --format "$format"
