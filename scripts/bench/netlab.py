#!/usr/bin/env python3
"""Measured against predicted on real shaped links: for each host count and link rate, a netlab comes up
(`nanodist netlab up`), `nanodist calibrate --engine mpi` runs inside it (one rank a host: it measures the
link between hosts and the compute of ranks that share this machine) and writes a profile; then every
method trains the quick-start model (config/quickstart-char.toml, MPI engine, one thread a rank) across the
hosts, and `nanodist predict RUN_DIR --cluster PROFILE --ran-on PROFILE --measured` prices the run: its
collectives on the measured link, its compute and codec as the run measured them (it ran on the machine the
profile describes), so that the error is the network model's; the prediction with compute from FLOPs and the
calibrated throughput is printed beside it. Each row: measured ms/step (the mean
over every step), predicted ms/step, the error, and the bytes each rank sent a step.

With --slow-host RATE, host 1's link is shaped to RATE before calibration (one straggler's link): the
profile then gives node 1 a link of its own, and the table shows which methods one slow link hurts most.

With --target-loss L, every run evaluates every --eval-interval steps and the table adds, for the first
evaluation at or below L, the measured training time (the steps' own time, without the evaluations),
the predicted one, and the run's elapsed wall-clock (evaluations included).

    sudo python3 scripts/bench/netlab.py [--hosts 2 4] [--rates 50mbit 500mbit] [--steps 30] [--repeat 1] [--only all-reduce DiLoCo]

Needs root, iproute2, Open MPI, a release build with the mpi feature (cargo build --release --features mpi)
and data/shakespeare_char (scripts/quickstart.sh). Exits 1 when a prediction is off by more than
--tolerance (default 0.15).

With --repeat N, each method runs N times in each lab (one calibration): the row is the run whose error is
the median, with the errors' range beside it (on a machine whose hosts share cores, one run's error moves
by several points against another's).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = [
    ("all-reduce", []),
    ("gossip ring", ['train.backend="decentdp"', 'train.topology="ring"', "train.overlap=false"]),
    ("gossip ring overlap", ['train.backend="decentdp"', 'train.topology="ring"', "train.overlap=true"]),
    ("gossip exp", ['train.backend="decentdp"', 'train.topology="exp"', "train.overlap=false"]),
    ("gossip exp overlap", ['train.backend="decentdp"', 'train.topology="exp"', "train.overlap=true"]),
    ("top-k 1%", ['train.compression={ name = "topk", density = 0.01 }']),
    ("PowerSGD r4", ['train.compression={ name = "powersgd", rank = 4, start_iter = 2 }']),
    ("CHOCO top-10%", ['train.backend="decentdp"', 'train.topology="ring"',
                       'train.compression={ name = "topk", density = 0.1 }']),
    ("DiLoCo H=10", ['train.backend="diloco"', "train.diloco={ sync_every = 10 }"]),
    ("streaming DiLoCo fp8", ['train.backend="diloco"',
                              'train.diloco={ sync_every = 10, fragments = 2, fragment_delay = 2, quantize = "fp8" }']),
    ("DeMo", ['train.backend="demo"', 'train.optim={ name = "sgd" }']),
    ("SPARTA p=0.005", ['train.backend="sparta"', "train.sparta={ p = 0.005 }"]),
]


def sh(args, **kw):
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def train(a, lab, out, run, sets):
    cmd = [a.nanodist, "netlab", "run", "--name", lab, "--", "train",
           os.path.join(ROOT, "config", "quickstart-char.toml")]
    every = a.eval_interval if a.target_loss else 10 * a.steps
    for s in [f"log_dir={json.dumps(out)}", f"log.run_name={json.dumps(run)}", f"data_dir={json.dumps(a.data)}",
              f"train.n_steps={a.steps}", "train.lr_schedule.warmup_steps=5", "log.log_interval=5",
              f"log.eval_interval={every}", "log.ckpt_interval=0", "train.threads=1",
              'train.engine="mpi"'] + sets:
        cmd += ["--set", s]
    sh(cmd, env=dict(os.environ, RAYON_NUM_THREADS="1"))
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def measured(rows):
    """Mean ms/step over every step (a DiLoCo sync's included, as the prediction averages them), and bytes
    a step."""
    trained = [r for r in rows if r["step"] > 0]
    ms, prev = 0.0, 0
    for r in trained:
        ms += r["ms_per_step"] * (r["step"] - prev)
        prev = r["step"]
    return ms / prev, sum(r["comm_bytes"] for r in trained) / prev


def reached(rows, loss):
    """(training seconds, elapsed seconds) to the first evaluation at or below `loss` (None: not reached).
    Training seconds sum the rows' ms/step over their steps; elapsed adds the evaluations."""
    train, prev = 0.0, 0
    for r in rows:
        train += r["ms_per_step"] * (r["step"] - prev) / 1e3
        prev = r["step"]
        if r.get("val_loss") is not None and r["val_loss"] <= loss:
            return train, r["elapsed_s"]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanodist", default=os.path.join(ROOT, "target", "release", "nanodist"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "shakespeare_char"))
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", nargs="+", default=["50mbit", "500mbit"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", nargs="+", help="methods to run (names as in the table)")
    ap.add_argument("--slow-host", metavar="RATE", help="shape host 1's link to RATE (before calibration)")
    ap.add_argument("--target-loss", type=float)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each method in each lab (the row: the median)")
    ap.add_argument("--lab", default="bench")
    ap.add_argument("--keep", help="keep the runs and profiles in this directory")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    out = a.keep or tempfile.mkdtemp(prefix="nanodist-netlab-")
    methods = [m for m in METHODS if not a.only or m[0] in a.only]
    head = ("| hosts | link | method | measured ms/step | predicted ms/step | error | predicted from FLOPs | "
            "sent/step |")
    if a.target_loss:
        head += f" to {a.target_loss}: measured training s | predicted s | elapsed s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    worst = 0.0
    try:
        for hosts in a.hosts:
            for rate in a.rates:
                worst = max(worst, lab_rows(a, out, methods, hosts, rate))
    finally:
        subprocess.run([a.nanodist, "netlab", "down", "--name", a.lab], capture_output=True)
        if not a.keep:
            shutil.rmtree(out, True)
    print(f"\nworst error {100 * worst:.1f}% (tolerance {100 * a.tolerance:.0f}%)")
    sys.exit(0 if worst <= a.tolerance else 1)


def lab_rows(a, out, methods, hosts, rate):
    """One lab: calibrate, then every method measured and predicted; the worst relative error."""
    sh([a.nanodist, "netlab", "up", "--hosts", str(hosts), "--rate", rate, "--name", a.lab])
    link = rate
    if a.slow_host:
        sh([a.nanodist, "netlab", "shape", "1", a.slow_host, "--name", a.lab])
        link = f"{rate}, host 1 {a.slow_host}"
    profile = os.path.join(out, f"lab-{hosts}-{rate}{'-slow' if a.slow_host else ''}.toml")
    sh([a.nanodist, "netlab", "run", "--name", a.lab, "--", "calibrate", "--engine", "mpi", "--output", profile],
       env=dict(os.environ, RAYON_NUM_THREADS="1"))
    worst = 0.0
    for name, sets in methods:
        base = f"{hosts}-{rate}{'-slow' if a.slow_host else ''}-{name}".replace(" ", "_").replace("%", "pct").replace("=", "")
        runs = [priced(a, out, base if a.repeat == 1 else f"{base}-{i + 1}", sets, profile) for i in range(a.repeat)]
        # The row is the run of the median error; with repeats, the errors' range beside it.
        runs.sort(key=lambda r: r["err"])
        r = runs[len(runs) // 2]
        worst = max(worst, abs(r["err"]))
        spread = f" ({100 * runs[0]['err']:+.1f}% to {100 * runs[-1]['err']:+.1f}%)" if a.repeat > 1 else ""
        line = (f"| {hosts} | {link} | {name} | {r['ms']:.1f} | {r['pred']['ms_per_step']:.1f} | "
                f"{100 * r['err']:+.1f}%{spread} | "
                f"{r['flops']:.1f} ({100 * (r['flops'] / r['ms'] - 1):+.0f}%) | {r['sent'] / 1e3:.1f} kB |")
        if a.target_loss:
            t = reached(r["rows"], a.target_loss)
            p = next((e["predicted_s"] for e in r["pred"]["evals"] if e["val_loss"] <= a.target_loss), None)
            line += (f" {'-' if t is None else f'{t[0]:.1f}'} | {'-' if p is None else f'{p:.1f}'} |"
                     f" {'-' if t is None else f'{t[1]:.1f}'} |")
        print(line, flush=True)
    return worst


def priced(a, out, run, sets, profile):
    """One run of a method in the lab, measured, and priced by `predict` on the lab's profile (from the
    run's own compute with --measured, and from FLOPs)."""
    rows = train(a, a.lab, out, run, sets)
    ms, sent = measured(rows)
    ask = [a.nanodist, "predict", os.path.join(out, run), "--cluster", profile, "--ran-on", profile, "--json"]
    flops = json.loads(sh(ask))["ms_per_step"]
    pred = json.loads(sh(ask + ["--measured"]))
    return {"rows": rows, "ms": ms, "sent": sent, "flops": flops, "pred": pred,
            "err": pred["ms_per_step"] / ms - 1}


if __name__ == "__main__":
    main()
