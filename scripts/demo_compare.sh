#!/usr/bin/env bash
# The README's comparison example: the quick-start model for 300 steps on 4 local workers, by dense
# all-reduce, ring gossip and PowerSGD rank 4 (from step 50); then the table and the plot.
# Needs ./target/release/nanodist and data/shakespeare_char (scripts/quickstart.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-log/compare}
run() {
    local name=$1
    shift
    ./target/release/nanodist train config/quickstart-char.toml --workers 4 --set train.n_steps=300 \
        --set log.eval_interval=50 --set log.eval_steps=10 --set log.ckpt_interval=0 \
        --set "log_dir=\"$out\"" --set "log.run_name=\"$name\"" "$@" >/dev/null
}
run dense
run ring --set train.backend=decentdp --set train.topology=ring
run powersgd --set 'train.compression={ name = "powersgd", rank = 4, start_iter = 50 }'
./target/release/nanodist compare "$out/dense" "$out/ring" "$out/powersgd"
./target/release/nanodist plot "$out/dense" "$out/ring" "$out/powersgd" --output "$out/compare.png"
