#!/usr/bin/env python3
"""Low-communication quality table: the quick-start model (config/quickstart-char.toml) with a global batch
of 24 sequences on 4 and 8 local workers (equal tokens for every run), trained by all-reduce and by each
method of the low-communication family. Prints, per run: method, workers, final val loss and its change
against all-reduce at the same worker count, and the mean bytes sent per worker per step (rank 0's
count; control traffic such as loss means is not in it).

    python3 scripts/bench/lowcomm.py [--steps 600] [--workers 4 8] [--only "DiLoCo H=10" "MuLoCo H=10"]

SparseLoCo's rows (2-bit values, 3% and the default 1.5% of each chunk of 4096, error-feedback decay 0.95)
run DiLoCo's outer SGD at lr 1 without momentum, as the paper does.

Muon's rows (all-reduce with Muon, and MuLoCo: Muon as DiLoCo's inner optimizer) take the reference's
learning rate, 0.02 (its AdamW group 0.015x that), with the quick-start's cosine schedule scaled to it.

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

MUON = ['train.optim={ name = "muon" }', "train.lr_schedule.lr=0.02", "train.lr_schedule.eta_min=0.002"]

# SparseLoCo's outer step: plain SGD at lr 1 (its decaying error feedback stands in for the momentum).
SPARSELOCO = ['train.backend="diloco"', "train.diloco={ sync_every = 10, outer_lr = 1.0, outer_momentum = 0.0 }"]

RUNS = [
    ("all-reduce", []),
    ("DiLoCo H=10", ['train.backend="diloco"', "train.diloco={ sync_every = 10 }"]),
    ("DiLoCo H=50", ['train.backend="diloco"', "train.diloco={ sync_every = 50 }"]),
    ("Streaming DiLoCo H=50 F=2 tau=5", ['train.backend="diloco"',
                                          "train.diloco={ sync_every = 50, fragments = 2, fragment_delay = 5 }"]),
    ("DiLoCo H=50 + fp8", ['train.backend="diloco"', 'train.diloco={ sync_every = 50, quantize = "fp8" }']),
    ("SPARTA p=0.005", ['train.backend="sparta"', "train.sparta={ p = 0.005 }"]),
    ("DeMo", ['train.backend="demo"', 'train.optim={ name = "sgd" }']),
    ("DiLoCo H=10 + fp8", ['train.backend="diloco"', 'train.diloco={ sync_every = 10, quantize = "fp8" }']),
    ("SparseLoCo H=10 2-bit 3%", SPARSELOCO + ['train.compression={ name = "sparseloco", density = 0.03 }']),
    ("SparseLoCo H=10 2-bit 1.5%", SPARSELOCO + ['train.compression={ name = "sparseloco" }']),
    ("SparseLoCo H=10 f32 3%", SPARSELOCO + ['train.compression={ name = "sparseloco", density = 0.03, bits = 32 }']),
    ("SparseLoCo H=10 2-bit 100%", SPARSELOCO + ['train.compression={ name = "sparseloco", density = 1.0 }']),
    ("DiLoCo H=10 eager", ['train.backend="diloco"', "train.diloco={ sync_every = 10, eager = true }"]),
    ("LocalSGD H=10", ['train.backend="diloco"', "train.diloco={ sync_every = 10, outer_lr = 1.0, outer_momentum = 0.0 }"]),
    ("LocalSGD H=10 eager", ['train.backend="diloco"',
                             "train.diloco={ sync_every = 10, outer_lr = 1.0, outer_momentum = 0.0, eager = true }"]),
    ("SparseLoCo H=10 2-bit 3% Nesterov", ['train.backend="diloco"', "train.diloco={ sync_every = 10 }",
                                           'train.compression={ name = "sparseloco", density = 0.03 }']),
    ("all-reduce Muon", MUON),
    ("MuLoCo H=10", ['train.backend="diloco"', "train.diloco={ sync_every = 10 }"] + MUON),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--only", nargs="+", help="methods besides all-reduce (names as in the table)")
    a = ap.parse_args()
    runs = [r for r in RUNS if not a.only or r[0] == "all-reduce" or r[0] in a.only]
    exe = os.path.join(ROOT, "target", "release", "nanodist")
    out = tempfile.mkdtemp(prefix="nanodist-lowcomm-")
    atexit.register(shutil.rmtree, out, True)  # runs leave GBs of checkpoints
    table = []
    for workers in a.workers:
        base = None
        for name, sets in runs:
            run = f"{name}-{workers}".replace(" ", "_").replace("=", "").replace("+", "")
            cmd = [exe, "train", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", str(workers),
                   "--set", "train.global_batch_size=24", "--set", f"train.n_steps={a.steps}",
                   "--set", f"log.eval_interval={a.steps}", "--set", "log.ckpt_interval=0",
                   "--set", f"log_dir={json.dumps(out)}", "--set", f'log.run_name="{run}"']
            for s in sets:
                cmd += ["--set", s]
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            metrics = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
            val = metrics[-1]["val_loss"]
            per_step = sum(m["comm_bytes"] for m in metrics) / a.steps
            base = base if base is not None else val
            table.append((name, workers, val, 100 * (val / base - 1), per_step))
            print(f"done: {name}, {workers} workers", flush=True)
    print(f"\nquick-start model, global batch 24 x 64 tokens, {a.steps} steps (equal tokens for every run)")
    print("| method | workers | final val loss | vs all-reduce | bytes/step/worker |")
    print("|---|---|---|---|---|")
    for name, workers, val, rel, b in table:
        print(f"| {name} | {workers} | {val:.4f} | {rel:+.1f}% | {b / 1e6:.4f} MB |")


if __name__ == "__main__":
    main()
