#!/usr/bin/env python3
"""Today's baselines at small scale: the quick-start model (config/quickstart-char.toml) on 8 local workers
with a global batch of 24 sequences x 64 tokens (equal tokens for every run), trained by DiLoCo and the
methods papers now compare it with, and with IID and non-IID data. Prints, per run: final val loss, its
change against all-reduce with IID data, the mean bytes each worker sent per step (rank 0's count, the
algorithm's traffic alone), and the run's time predicted by `nanodist predict` on two cluster profiles
(8 ranks at each profile's own layout; ms/step x steps).

    python3 scripts/bench/baselines.py [--steps 600] [--clusters a40-25gbe wan-1g] [--only "MuLoCo H=10"]

Non-IID rows give each worker its own contiguous eighth of the corpus (`[worker_data] name = "shard"`:
different plays of the Shakespeare corpus). SparseLoCo runs the paper's outer step (SGD, lr 1, no
momentum); Muon rows the reference's learning rate (0.02) with the quick-start's schedule scaled to it.

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
NANODIST = os.path.join(ROOT, "target", "release", "nanodist")

DILOCO = 'train.backend="diloco"'
H10 = "train.diloco={ sync_every = 10 }"
MUON = ['train.optim={ name = "muon" }', "train.lr_schedule.lr=0.02", "train.lr_schedule.eta_min=0.002"]
SHARD = 'worker_data={ name = "shard" }'
GOSSIP = ['train.backend="decentdp"', 'train.topology="exp"']

RUNS = [
    ("all-reduce", []),
    ("DiLoCo H=10", [DILOCO, H10]),
    ("MuLoCo H=10", [DILOCO, H10] + MUON),
    ("DiLoCo H=10 fp8", [DILOCO, 'train.diloco={ sync_every = 10, quantize = "fp8" }']),
    ("SparseLoCo H=10 2-bit 3%", [DILOCO, "train.diloco={ sync_every = 10, outer_lr = 1.0, outer_momentum = 0.0 }",
                                  'train.compression={ name = "sparseloco", density = 0.03 }']),
    ("DiLoCo H=10 eager", [DILOCO, "train.diloco={ sync_every = 10, eager = true }"]),
    ("DiLoCo H=10 2 groups x 4", [DILOCO, "train.diloco={ sync_every = 10, group_size = 4 }"]),
    ("gossip exp", GOSSIP),
    ("all-reduce non-IID", [SHARD]),
    ("DiLoCo H=10 non-IID", [DILOCO, H10, SHARD]),
    ("gossip exp non-IID", GOSSIP + [SHARD]),
]


def predicted_s(run_dir, cluster, steps):
    """The run's time on `cluster`: predict's ms/step for its config on 8 ranks, times the steps."""
    out = subprocess.run([NANODIST, "predict", os.path.join(run_dir, "config.toml"), "--workers", "8",
                          "--cluster", cluster, "--json"], cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["ms_per_step"] * steps / 1e3


def train(name, sets, steps, out):
    run = name.replace(" ", "_").replace("=", "").replace("%", "pct")
    cmd = [NANODIST, "train", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", "8",
           "--set", "train.global_batch_size=24", "--set", f"train.n_steps={steps}",
           "--set", f"log.eval_interval={steps}", "--set", "log.ckpt_interval=0",
           "--set", f"log_dir={json.dumps(out)}", "--set", f'log.run_name="{run}"']
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, run)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--clusters", nargs=2, default=["a40-25gbe", "wan-1g"])
    ap.add_argument("--only", nargs="+", help="methods besides all-reduce (names as in the table)")
    a = ap.parse_args()
    runs = [r for r in RUNS if not a.only or r[0] == "all-reduce" or r[0] in a.only]
    out = tempfile.mkdtemp(prefix="nanodist-baselines-")
    atexit.register(shutil.rmtree, out, True)
    table, base = [], None
    for name, sets in runs:
        run_dir = train(name, sets, a.steps, out)
        metrics = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
        val = metrics[-1]["val_loss"]
        per_step = sum(m["comm_bytes"] for m in metrics) / a.steps
        base = base if base is not None else val
        times = [predicted_s(run_dir, c, a.steps) for c in a.clusters]
        table.append((name, val, 100 * (val / base - 1), per_step, times))
        print(f"done: {name}", flush=True)
    print(f"\nquick-start model, 8 workers, global batch 24 x 64 tokens, {a.steps} steps (equal tokens)")
    print(f"| method | final val loss | vs all-reduce | bytes/step/worker | predicted {a.clusters[0]} "
          f"| predicted {a.clusters[1]} |")
    print("|---|---|---|---|---|---|")
    for name, val, rel, b, (t0, t1) in table:
        print(f"| {name} | {val:.4f} | {rel:+.1f}% | {b / 1e6:.4f} MB | {t0:.2f} s | {t1:.1f} s |")


if __name__ == "__main__":
    main()
