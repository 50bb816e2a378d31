#!/usr/bin/env bash
# The figure in docs/predict.md of val loss against predicted wall-clock time: the runs of scripts/demo_compare.sh
# (the quick-start model for 300 steps on 4 local workers by all-reduce, ring gossip and PowerSGD rank 4
# from step 50) plus DiLoCo (H = 10), priced on two clusters (a100-ib100 solid, wan-1g dashed), with the
# comparison table on wan-1g.
# Needs ./target/release/nanodist and data/shakespeare_char (scripts/quickstart.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-log/predict}
./scripts/demo_compare.sh "$out" >/dev/null
./target/release/nanodist train config/quickstart-char.toml --workers 4 --set train.n_steps=300 \
    --set log.eval_interval=50 --set log.eval_steps=10 --set log.ckpt_interval=0 \
    --set "log_dir=\"$out\"" --set 'log.run_name="diloco"' \
    --set train.backend=diloco --set 'train.diloco={ sync_every = 10 }' >/dev/null
runs=("$out/dense" "$out/ring" "$out/powersgd" "$out/diloco")
./target/release/nanodist compare "${runs[@]}" --cluster wan-1g
./target/release/nanodist plot "${runs[@]}" --cluster a100-ib100 --cluster wan-1g --output "$out/predict.png"
