#!/usr/bin/env python3
"""Reducer quality table: the quick-start model (config/quickstart-char.toml) trained with 4 local workers
by dense all-reduce and by each compressed reducer, at equal steps. Top-k compresses from step 0, PowerSGD
from step steps/5, Radius from step steps/2 (it is meant to switch from a dense run). Prints, per run: reducer, setting,
mean bytes sent per worker per step over the compressed phase and over the whole run, final val loss, and
its ratio to dense.

    python3 scripts/bench/reducers.py [--steps 600] [--workers 4]

Needs `./target/release/nanodist` (cargo build --release) and data/shakespeare_char (scripts/quickstart.sh).
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def runs(steps):
    """(name, setting, compression section, first compressed step)."""
    start = steps // 5  # dense warm-up before compression, as the references do
    half = steps // 2
    return [
        ("dense", "", None, 0),
        ("topk", "density 0.01", '{ name = "topk", density = 0.01 }', 0),
        # Radius switches from dense training late, as its workflow does (dense to step 60k of 300k).
        ("radius", "density 0.1", f'{{ name = "radius", density = 0.1, threshold = {half}, interval = 100, range = 0 }}', half),
        ("radius correction", "density 0.1", f'{{ name = "radius", density = 0.1, threshold = {half}, interval = 100, range = 0, correction = true }}', half),
        ("powersgd", "rank 4", f'{{ name = "powersgd", rank = 4, start_iter = {start} }}', start),
        ("powersgd 1-allreduce", "rank 4", f'{{ name = "powersgd", rank = 4, start_iter = {start}, single_allreduce = true }}', start),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    exe = os.path.join(ROOT, "target", "release", "nanodist")
    table = runs(a.steps)
    out = tempfile.mkdtemp(prefix="nanodist-reducers-")
    atexit.register(shutil.rmtree, out, True)  # runs leave GBs of checkpoints
    rows = []
    for name, setting, comp, start in table:
        run = name.replace(" ", "-")
        cmd = [exe, "train", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", str(a.workers),
               "--set", f"train.n_steps={a.steps}", "--set", f"log.eval_interval={a.steps}",
               "--set", "log.ckpt_interval=0", "--set", f"log_dir={json.dumps(out)}",
               "--set", f'log.run_name="{run}"']
        if comp:
            cmd += ["--set", f"train.compression={comp}"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        metrics = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
        interval = metrics[1]["step"] - metrics[0]["step"]
        total = sum(m["comm_bytes"] for m in metrics) / a.steps
        late = [m for m in metrics if m["step"] > start + interval]
        compressed = sum(m["comm_bytes"] for m in late) / (len(late) * interval)
        rows.append((name, setting, compressed, total, metrics[-1]["val_loss"]))
        print(f"done: {name}", flush=True)
    dense = rows[0][4]
    print(f"\n{a.workers} workers, {a.steps} steps (quick-start model); compression from step 0 (topk), "
          f"{a.steps // 5} (powersgd), {a.steps // 2} (radius)")
    print(f"| reducer | setting | bytes/step compressed phase | bytes/step whole run | final val loss | vs dense |")
    print("|---|---|---|---|---|---|")
    for name, setting, c, t, v in rows:
        print(f"| {name} | {setting or '-'} | {c/1e6:.3f} MB | {t/1e6:.3f} MB | {v:.4f} | {100*(v/dense-1):+.1f}% |")


if __name__ == "__main__":
    main()
