#!/usr/bin/env python3
"""From the command to the first step: each backend on the quick-start model at 512 local workers (one
sequence each), the seconds from the command to the start of the first step, as the run logs it
(`startup_s`: config, plan, the workers' state, every worker built; the evaluation at start is off), and
the first step's own time (the workers' buffers are first touched there). Each run is stopped once its
first row is written (512 workers' checkpoints would take gigabytes). Then the wall time from the launch
to that row (the command, the first step, and the row), comparable with builds that do not log
`startup_s`, and the process's peak resident memory at that row (VmHWM: what the start and the first step
had to map). Above the table, the rate at which this machine maps fresh memory, measured first (on a VM
that returns freed memory to its host, the first touch costs more than the kernel's zeroing).

Compressed gossip with `consensus_step = "auto"` tunes its gamma in the plan, before any worker exists (and
512 CHOCO workers keep 2 model-sized buffers per group they meet: 41 GB on exp, more than this machine
has), so its rows time `nanodist check` at the same world, twice in a cache directory of its own
(`NANODIST_CACHE_DIR`): first tuning, then reading the cached answer.

    python3 scripts/bench/startup.py [--workers 512] [--only NAME ...] [--nanodist PATH] [--timeout 300]

Needs a release build (cargo build --release) and data/shakespeare_char (scripts/quickstart.sh).
"""
import argparse
import ctypes
import json
import mmap
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOSSIP = ['train.backend="decentdp"']
RUNS = [
    ("all-reduce", []),
    ("gossip ring", GOSSIP + ['train.topology="ring"']),
    ("gossip exp", GOSSIP + ['train.topology="exp"']),
    ("top-k 1%", ['train.compression={ name = "topk", density = 0.01 }']),
    ("Radius 1%", ['train.compression={ name = "radius", density = 0.01, threshold = 3 }']),
    ("PowerSGD r4", ['train.compression={ name = "powersgd", rank = 4 }']),
    ("DiLoCo H=10", ['train.backend="diloco"', "train.diloco={ sync_every = 10 }"]),
    ("SPARTA p=0.005", ['train.backend="sparta"', "train.sparta={ p = 0.005 }"]),
    ("DeMo", ['train.backend="demo"', 'train.optim={ name = "sgd" }']),
]
# Compressed gossip with a tuned consensus step, per topology and compressor.
TUNED = [
    (f"CHOCO {name} {topo} auto", GOSSIP + [f'train.topology="{topo}"',
                                             f'train.compression={{ {c}, consensus_step = "auto" }}'])
    for topo in ["complete", "exp", "ring"]
    for name, c in [("top-10%", 'name = "topk", density = 0.1'),
                    ("random-10%", 'name = "randomk", density = 0.1'),
                    ("QSGD-16", 'name = "qsgd", levels = 16'),
                    ("sign", 'name = "sign"')]
]


def fresh_memory_rate(gb=4.0, threads=2):
    """GB/s at which this process maps and writes `gb` of fresh memory from `threads` threads (memset
    through ctypes, which runs without the GIL): the floor under any start that must map its buffers."""
    size = int(gb * 1e9) // mmap.PAGESIZE * mmap.PAGESIZE
    m = mmap.mmap(-1, size)
    view = ctypes.c_char.from_buffer(m)
    base, part = ctypes.addressof(view), size // threads
    workers = [threading.Thread(target=ctypes.memset, args=(base + i * part, 1, part)) for i in range(threads)]
    began = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.monotonic() - began
    del view
    m.close()
    return size / 1e9 / seconds


def peak_gb(pid):
    """The process's peak resident memory so far (VmHWM), in GB."""
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb * 1024 / 1e9


def first_row(exe, out, name, workers, sets, env, timeout):
    """The run's first metrics row (None: refused by the memory check, more workers than fit here)."""
    run_name = name.replace(" ", "-").replace("%", "pct").replace("=", "")
    args = [exe, "train", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", str(workers),
            "--set", f"log_dir={json.dumps(out)}", "--set", f"log.run_name={json.dumps(run_name)}",
            "--set", "train.n_steps=4", "--set", f"train.global_batch_size={workers}",
            "--set", "train.lr_schedule.warmup_steps=0", "--set", "log.eval_at_start=false",
            "--set", "log.log_interval=1", "--set", "log.ckpt_interval=0", "--fresh"]
    for s in sets:
        args += ["--set", s]
    metrics = os.path.join(out, run_name, "metrics.jsonl")
    began = time.monotonic()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while time.monotonic() - began < timeout:
            if os.path.exists(metrics):
                with open(metrics) as f:
                    lines = [json.loads(line) for line in f if line.strip()]
                if lines:
                    return dict(lines[0], wall_s=time.monotonic() - began, peak_gb=peak_gb(proc.pid))
            if proc.poll() is not None:
                err = proc.stderr.read()
                if "of memory" in err and "available" in err:
                    return None
                raise SystemExit(f"{name} failed before its first row:\n{err}")
            time.sleep(0.05)
        raise SystemExit(f"{name}: no row within {timeout} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(os.path.join(out, run_name), ignore_errors=True)


def check_seconds(exe, workers, sets, env):
    """Wall seconds of `nanodist check` (the plan, with its tuning) at `workers` local workers."""
    args = [exe, "check", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", str(workers),
            "--set", f"train.global_batch_size={workers}"]
    for s in sets:
        args += ["--set", s]
    began = time.monotonic()
    done = subprocess.run(args, cwd=ROOT, env=dict(env, NANODIST_MEMORY_GB="1000"), capture_output=True,
                          text=True)
    took = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"check failed:\n{done.stderr}")
    return took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=512)
    ap.add_argument("--only", nargs="+", default=None, help="names of the rows to run")
    ap.add_argument("--nanodist", default=os.path.join(ROOT, "target", "release", "nanodist"))
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    runs = [(n, s) for n, s in RUNS + TUNED if a.only is None or n in a.only]
    if not runs:
        ap.error(f"no such rows; choose from {[n for n, _ in RUNS + TUNED]}")
    out = tempfile.mkdtemp(prefix="nanodist-startup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cache = tempfile.mkdtemp(prefix="nanodist-cache-")
    env = dict(os.environ, NANODIST_CACHE_DIR=cache)
    try:
        print(f"Fresh memory, mapped and written by 2 threads: {fresh_memory_rate():.2f} GB/s (4 GB)\n")
        print("| backend | workers | command to first step (s) | first step (ms) | first row written (s) "
              "| peak memory at the first row (GB) |")
        print("|---|---|---|---|---|---|")
        for name, sets in [r for r in runs if r in RUNS]:
            row = first_row(a.nanodist, out, name, a.workers, sets, env, a.timeout)
            if row is None:
                print(f"| {name} | {a.workers} | does not fit in this machine's memory | | | |", flush=True)
                continue
            startup = f"{row['startup_s']:.2f}" if "startup_s" in row else "not logged"
            print(f"| {name} | {a.workers} | {startup} | {row['ms_per_step']:.0f} | {row['wall_s']:.1f} "
                  f"| {row['peak_gb']:.2f} |", flush=True)
        tuned = [r for r in runs if r in TUNED]
        if tuned:
            print()
            print("| compressed gossip | workers | check, tuning (s) | check, cached (s) |")
            print("|---|---|---|---|")
        for name, sets in tuned:
            first, again = (check_seconds(a.nanodist, a.workers, sets, env) for _ in range(2))
            print(f"| {name} | {a.workers} | {first:.2f} | {again:.2f} |", flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
