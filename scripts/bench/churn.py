#!/usr/bin/env python3
"""What unreliable and unequal workers cost each method (`[train.membership]`): the quick-start model
(config/quickstart-char.toml, global batch 16) on 8 local workers, for all-reduce, DiLoCo, streaming DiLoCo,
gossip (exp), CHOCO, top-k and PowerSGD, with no churn, with 10% and 30% of the worker-steps away (the seeded random process:
every worker but 0 stays an exponential number of steps, then is away `--down` steps), and with one worker
3x slower. Runs with churn train more steps, so that every run sees about the same tokens (each worker keeps
its batch, so the global batch shrinks while workers are away). Per run: the tokens seen, the final val
loss, and the simulated seconds on the cluster profile `--cluster` (the rows' `sim_s`: each worker's compute
and communication there, synchronous steps waiting for their slowest member).

    python3 scripts/bench/churn.py [--steps 600] [--cluster t4-ib] [--down 20] [--only METHOD ...]
                                   [--nanodist PATH]

Needs a release build (cargo build --release) and data/shakespeare_char (scripts/quickstart.sh).
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = 8

METHODS = [
    ("all-reduce", []),
    ("DiLoCo H=20", ['train.backend="diloco"', "train.diloco={ sync_every = 20 }"]),
    ("streaming DiLoCo H=20 x4", ['train.backend="diloco"',
                                  "train.diloco={ sync_every = 20, fragments = 4, fragment_alpha = 0.5 }"]),
    ("gossip exp", ['train.backend="decentdp"', 'train.topology="exp"']),
    ("CHOCO top-10% exp", ['train.backend="decentdp"', 'train.topology="exp"',
                           'train.compression={ name = "topk", density = 0.1 }']),
    ("top-k 1%", ['train.compression={ name = "topk", density = 0.01 }']),
    ("PowerSGD r4", ['train.compression={ name = "powersgd", rank = 4, start_iter = 60 }']),
]


def settings(down):
    """(name, membership keys, the expected fraction of worker-steps away)."""
    out = [("no churn", "", 0.0)]
    for pct in (10, 30):
        # Workers 1..7 away down / (up + down) of the time: that times 7/8 of all worker-steps.
        away = pct / 100 * WORKERS / (WORKERS - 1)
        up = down / away - down
        out.append((f"{pct}% churn", f"mean_steps_up = {up:.1f}, down_steps = {down}, ", pct / 100))
    out.append(("one worker 3x slower", f"stragglers = [{{ worker = {WORKERS - 1}, slowdown = 3.0 }}], ", 0.0))
    return out


def run(exe, out, name, steps, sets):
    args = [exe, "train", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", str(WORKERS),
            "--set", f"log_dir={json.dumps(out)}", "--set", f"log.run_name={json.dumps(name)}",
            "--set", f"train.n_steps={steps}", "--set", "train.global_batch_size=16",
            "--set", f"log.eval_interval={steps}", "--set", "log.eval_steps=20", "--set", "log.ckpt_interval=0",
            "--set", "log.log_interval=10", "--set", "log.eval_at_start=false"]
    for s in sets:
        args += ["--set", s]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600, help="steps of the runs without churn")
    ap.add_argument("--cluster", default="t4-ib")
    ap.add_argument("--down", type=int, default=20)
    ap.add_argument("--only", nargs="+", metavar="METHOD", help="these methods alone (their names in the table)")
    ap.add_argument("--nanodist", default=os.path.join(ROOT, "target", "release", "nanodist"))
    a = ap.parse_args()
    methods = [m for m in METHODS if not a.only or m[0] in a.only]
    if a.only and len(methods) != len(a.only):
        raise SystemExit(f"--only: methods are {', '.join(m[0] for m in METHODS)}")
    out = tempfile.mkdtemp(prefix="nanodist-churn-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    print(f"quick-start model, {WORKERS} workers, global batch 16, simulated on {a.cluster}")
    print("| method | setting | steps | tokens | final val loss | simulated time | vs no churn |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for method, sets in methods:
        base = None
        for i, (setting, keys, away) in enumerate(settings(a.down)):
            steps = round(a.steps / (1 - away))
            membership = f'train.membership={{ {keys}cluster = "{a.cluster}", seed = 1 }}'
            rows = run(a.nanodist, out, f"{method}-{i}".replace(" ", "-").replace("%", "pct"), steps,
                       sets + [membership, f"train.lr_schedule.warmup_steps={steps // 10}"])
            last = rows[-1]
            base = base or last["sim_s"]
            print(f"| {method} | {setting} | {steps} | {last['tokens']} | {last['val_loss']:.4f} | "
                  f"{last['sim_s']:.2f} s | {last['sim_s'] / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
