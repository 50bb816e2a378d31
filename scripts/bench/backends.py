#!/usr/bin/env python3
"""The algorithms' own cost: each backend's step on the local engine against all-reduce's, where the network
costs nothing (in-process workers), so what is left is each method's own computing. The quick-start model
(config/quickstart-char.toml) with a global batch of 24 sequences on 4 and 8 local workers (the compressed
reducers compress from step 3; CHOCO's consensus step is "auto", tuned in the plan before the first step).
Per run: the mean ms/step over the steps after the first `--skip`, the share of it the sync backend computed
outside collectives (`sync_ms`: compression, decompression, mixing), the train loss at the last step beside
all-reduce's (a run whose loss ends above its first stops the sweep: it diverged, and the time of arithmetic
on huge values is not the method's), and the ratio to all-reduce's ms/step at the same worker count (target:
<= 1.25x), all-reduce measured again between every two backends (this ratio is to the mean of the all-reduce
runs on either side: the machine's speed drifts between minutes). With `--rounds N` the whole sweep runs N
times and each row gives the median over the rounds, with the ratio's range beside it.

    python3 scripts/bench/backends.py [--steps 60] [--skip 10] [--workers 4 8] [--rounds 1] [--nanodist PATH]
                                      [--only DeMo "top-k 1%" ...]   (all-reduce always runs: the baseline)

Needs a release build (cargo build --release) and data/shakespeare_char (scripts/quickstart.sh).
"""
import argparse
import atexit
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

SERIAL = itertools.count()  # every run its own directory (all-reduce runs many times)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUNS = [
    ("all-reduce", []),
    ("gossip ring", ['train.backend="decentdp"', 'train.topology="ring"']),
    ("gossip exp", ['train.backend="decentdp"', 'train.topology="exp"']),
    ("CHOCO top-10% exp", ['train.backend="decentdp"', 'train.topology="exp"',
                           'train.compression={ name = "topk", density = 0.1, consensus_step = "auto" }']),
    ("CHOCO random-k 10% exp", ['train.backend="decentdp"', 'train.topology="exp"',
                                'train.compression={ name = "randomk", density = 0.1, consensus_step = "auto" }']),
    ("CHOCO QSGD exp", ['train.backend="decentdp"', 'train.topology="exp"',
                        'train.compression={ name = "qsgd", consensus_step = "auto" }']),
    ("CHOCO sign exp", ['train.backend="decentdp"', 'train.topology="exp"',
                        'train.compression={ name = "sign", consensus_step = "auto" }']),
    ("top-k 1%", ['train.compression={ name = "topk", density = 0.01 }']),
    ("Radius 1%", ['train.compression={ name = "radius", density = 0.01, threshold = 3 }']),
    ("PowerSGD r4", ['train.compression={ name = "powersgd", rank = 4, start_iter = 2 }']),
    ("DiLoCo H=10", ['train.backend="diloco"', "train.diloco={ sync_every = 10 }"]),
    ("SPARTA p=0.005", ['train.backend="sparta"', "train.sparta={ p = 0.005 }"]),
    ("DeMo", ['train.backend="demo"', 'train.optim={ name = "sgd" }']),
]


def run(exe, out, name, workers, steps, sets):
    run_name = f"{name.replace(' ', '-').replace('%', 'pct')}-{workers}-{next(SERIAL)}"
    args = [exe, "train", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", str(workers),
            "--set", f"log_dir={json.dumps(out)}", "--set", f"log.run_name={json.dumps(run_name)}",
            "--set", f"train.n_steps={steps}", "--set", "train.global_batch_size=24",
            "--set", "log.eval_interval=100000", "--set", "log.ckpt_interval=0", "--set", "log.log_interval=1",
            "--set", "log.eval_at_start=false", "--set", "train.lr_schedule.warmup_steps=5"]
    for s in sets:
        args += ["--set", s]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} on {workers} workers failed:\n{done.stderr}")
    with open(os.path.join(out, run_name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # The run's final checkpoint goes at once: written back to disk during the runs that follow, it would
    # take their CPU time (a gossip run's replicas and CHOCO's public copies are hundreds of MB).
    shutil.rmtree(os.path.join(out, run_name))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=1, help="times to run the whole sweep")
    ap.add_argument("--nanodist", default=os.path.join(ROOT, "target", "release", "nanodist"))
    ap.add_argument("--only", nargs="+", default=None, help="backends to run besides all-reduce")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    names = [n for n, _ in RUNS]
    unknown = [n for n in a.only or [] if n not in names]
    if unknown:
        ap.error(f"unknown backend(s) {unknown}; choose from {names}")
    runs = [(n, s) for n, s in RUNS if a.only is None or n == "all-reduce" or n in a.only]
    out = tempfile.mkdtemp(prefix="nanodist-backends-")
    atexit.register(shutil.rmtree, out, True)
    # This machine's speed drifts between minutes: all-reduce runs again between every two backends, and
    # each backend is compared with the mean of the all-reduce runs just before and just after it.
    results = {}
    for r in range(a.rounds):
        for workers in a.workers:
            measure = lambda name, sets: mean_ms(run(a.nanodist, out, name, workers, a.steps, sets), a.skip)
            before = measure(*RUNS[0])
            for name, sets in runs[1:]:
                ms, share, loss = measure(name, sets)
                after = measure(*RUNS[0])
                base = (before[0] + after[0]) / 2
                row = (ms, share, loss, before[2], base, ms / base)
                results.setdefault((name, workers), []).append(row)
                print(f"round {r + 1}: {name} on {workers} workers: {ms / base:.2f}x", file=sys.stderr, flush=True)
                before = after
    print_table(results, a.rounds)


def print_table(results, rounds):
    """One row per backend and worker count: medians over the rounds, and the ratios' range."""
    spread = " (range over rounds)" if rounds > 1 else ""
    print(f"| backend | workers | ms/step | sync share | last loss (all-reduce's) | all-reduce beside it "
          f"| vs all-reduce{spread} |")
    print("|---|---|---|---|---|---|---|")
    for (name, workers), rows in results.items():
        ms, share, loss, base_loss, base, ratio = (statistics.median(col) for col in zip(*rows))
        ratios = [row[5] for row in rows]
        span = f" ({min(ratios):.2f}-{max(ratios):.2f})" if rounds > 1 else ""
        print(f"| {name} | {workers} | {ms:.1f} | {100 * share:.0f}% | {loss:.2f} ({base_loss:.2f}) | {base:.1f} "
              f"| {ratio:.2f}x{span} |")


def mean_ms(rows, skip):
    """Mean ms/step over the steps after `skip`, the share of it the backend's sync computed, and the
    train loss of the last step. A run whose loss ends above where it began has diverged: its step time
    (arithmetic on huge values) says nothing about the method's cost, so the sweep stops."""
    first, last = rows[0]["train_loss"], rows[-1]["train_loss"]
    if not last < first:
        raise SystemExit(f"the run diverged: train loss {first:.4f} at step {rows[0]['step']}, "
                         f"{last:.4f} at step {rows[-1]['step']}")
    rows = [r for r in rows if r["step"] > skip]
    ms = sum(r["ms_per_step"] for r in rows) / len(rows)
    return ms, sum(r.get("sync_ms", 0.0) for r in rows) / sum(r["ms_per_step"] for r in rows), last

if __name__ == "__main__":
    main()
