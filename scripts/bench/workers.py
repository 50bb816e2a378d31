#!/usr/bin/env python3
"""Many local workers on one machine: peak RSS and ms per worker-step of the quick-start model at 8 to 512
workers (batch 1 sequence per worker), on exp gossip with AccumAdamW and on all-reduce with AdamW, next to

  - the state floor: workers x the bytes of one worker's training state (parameters, gradient, the
    optimizer's moments and AccumAdamW's accumulated gradient, gossip's send buffer); all-reduce workers
    share one replica (parameters and moments, counted once) and each keeps its gradient, and
  - `nanodist check`'s estimate of the peak (the number it refuses runs by).

    python3 scripts/bench/workers.py [--workers 8 32 128 256 512] [--steps N] [--out DIR] [--only WORD]
                                     [--set KEY=VALUE ...]

Needs ./target/release/nanodist (cargo build --release) and data/shakespeare_char (scripts/quickstart.sh).
Every run ends with its evaluation and final checkpoint (part of the peak), then its directory is deleted:
512 workers write ~7 GB of checkpoint (--out puts the run directories elsewhere than a new temporary one,
e.g. /dev/shm where the disk is short: tmpfs pages are not the process's RSS). ms per worker-step is the median step time of the steps after the
first two, divided by the workers. Each run trains max(12, 600 / workers) steps unless --steps says otherwise:
8 workers' steps take ~30 ms, so 12 of them are too few for a stable median on a machine that is shared.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target/release/nanodist")
CONFIG = os.path.join(ROOT, "config/quickstart-char.toml")

# (label, --set overrides, whole-model buffers of state per worker (parameters, gradient, optimizer,
# backend), and those of the replica the workers share, once)
BACKENDS = [
    ("exp gossip + AccumAdamW",
     ["train.backend=decentdp", "train.topology=exp", "train.optim.name=accumadamw",
      "train.optim.accum_steps=4"], 2 + 3 + 1, 0),
    ("all-reduce + AdamW", ["train.backend=pytorchddp"], 1, 1 + 2),
]


def run(args, env=None):
    return subprocess.run([BIN] + args, capture_output=True, text=True, env=env)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128, 256, 512])
    ap.add_argument("--steps", type=int, help="steps per run (default: max(12, 600 / workers))")
    ap.add_argument("--out", help="where the run directories go (default: a new temporary directory)")
    ap.add_argument("--only", help="run only the backends whose label contains WORD (e.g. all-reduce)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides for every run (e.g. model.n_embd=64)")
    a = ap.parse_args()
    data = os.path.join(ROOT, "data/shakespeare_char")
    rows = []
    for label, sets, buffers, shared in BACKENDS:
        if a.only and a.only not in label:
            continue
        base = None
        for n in a.workers:
            steps = a.steps or max(12, 600 // n)
            out = tempfile.mkdtemp(prefix="nanodist-workers-", dir=a.out)
            overrides = sets + [
                f"data_dir={json.dumps(data)}", f"log_dir={json.dumps(out)}", "log.run_name=\"w\"",
                f"train.global_batch_size={n}", f"train.n_steps={steps}",
                "train.lr_schedule.warmup_steps=0", "log.eval_at_start=false", "log.eval_steps=2",
                "log.log_interval=1", f"log.eval_interval={steps}", f"log.ckpt_interval={steps}",
            ] + a.set
            args = [CONFIG, "--workers", str(n)] + [x for s in overrides for x in ("--set", s)]
            check = run(["check"] + args)
            if check.returncode != 0:
                print(f"{label} x {n}: check refused: {check.stderr.strip()}")
                shutil.rmtree(out, ignore_errors=True)
                continue
            text = check.stdout + check.stderr
            params = int(re.search(r"parameters\s+(\d+)", text).group(1))
            estimate = re.search(r"memory\s+([\d.]+ [kMG]B) peak", text).group(1)
            timed = subprocess.run(["/usr/bin/time", "-f", "%M", BIN, "train"] + args,
                                   capture_output=True, text=True)
            if timed.returncode != 0:
                print(f"{label} x {n}: train failed: {timed.stderr[-2000:]}")
                shutil.rmtree(out, ignore_errors=True)
                continue
            rss = int(timed.stderr.strip().splitlines()[-1]) * 1024
            with open(os.path.join(out, "w/metrics.jsonl")) as f:
                rows_of_run = [json.loads(line) for line in f]
            ms = statistics.median(r["ms_per_step"] for r in rows_of_run if r["step"] > 2)
            shutil.rmtree(out, ignore_errors=True)
            per = ms / n
            base = base or per
            floor = 4 * params * (buffers * n + shared)
            rows.append((label, n, rss, estimate, floor, rss / floor, ms, per, per / base))
            print(f"{label} x {n}: {rss / 1e9:.2f} GB, {per:.2f} ms per worker-step", flush=True)
    print()
    print("| backend | workers | peak RSS | `check` estimate | state floor | RSS / state floor | ms per step | "
          "ms per worker-step | vs the first |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, n, rss, est, floor, ratio, ms, per, rel in rows:
        print(f"| {label} | {n} | {rss / 1e9:.2f} GB | {est} | {floor / 1e9:.2f} GB | {ratio:.2f}x | {ms:.0f} | "
              f"{per:.2f} | {rel:.2f}x |")


if __name__ == "__main__":
    main()
