#!/usr/bin/env python3
"""Batches sampled ahead on the loader thread (`prefetch = true`, the default) against each step sampling its
own (`prefetch = false`): the quick-start model on one worker, reading a large token file that is not in the
page cache, as a dataset bigger than memory is read. Every run starts from a cold file (its pages dropped with
posix_fadvise(DONTNEED)), the two settings alternate, and each row is the mean over the steps after the
first logged interval: ms per step, and `data_ms`, the time the step waited for its batches (sampling
them, with their page faults, or waiting for the loader).

    python3 scripts/bench/prefetch.py [--gb 2] [--steps 100] [--repeats 2] [--dir DIR] [--nanodist PATH]

The token file (random tokens of the quick-start vocabulary) is made in DIR (default: a temporary folder
on the disk under /var/tmp; not tmpfs, whose pages cannot be dropped) and removed afterwards unless DIR is
given. Needs a release build (cargo build --release).
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTERVAL = 20


def make_tokens(path, gb):
    """`gb` GiB of uint16 tokens below 128 (the quick-start vocabulary), written 64 MiB at a time."""
    chunk = 64 << 20
    low = bytes(b & 0x7F for b in range(256))
    with open(path, "wb") as f:
        for _ in range((gb << 30) // chunk):
            data = bytearray(os.urandom(chunk).translate(low))
            data[1::2] = bytes(chunk // 2)
            f.write(data)


def drop_pages(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (a file just written) are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(exe, data_dir, out, prefetch, steps):
    """Mean ms/step and data ms/step over the rows after the first (the first holds the first step)."""
    drop_pages(os.path.join(data_dir, "train.bin"))
    name = f"prefetch-{prefetch}"
    args = [exe, "train", os.path.join(ROOT, "config", "quickstart-char.toml"),
            "--set", f"data_dir={json.dumps(data_dir)}", "--set", f"log_dir={json.dumps(out)}",
            "--set", f"log.run_name={json.dumps(name)}", "--set", f"train.n_steps={steps}",
            "--set", "train.lr_schedule.warmup_steps=0", "--set", "log.eval_at_start=false",
            "--set", f"log.log_interval={INTERVAL}", "--set", "log.ckpt_interval=0",
            "--set", f"log.eval_interval={steps}", "--set", "log.eval_steps=1",
            "--set", f"prefetch={str(prefetch).lower()}", "--fresh"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()][1:]
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    ms = sum(r["ms_per_step"] for r in rows) / len(rows)
    data = sum(r["data_ms"] for r in rows) / (len(rows) * INTERVAL)
    return ms, data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=int, default=2, help="GiB of tokens in the file")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="folder for the token file (kept)")
    ap.add_argument("--nanodist", default=os.path.join(ROOT, "target", "release", "nanodist"))
    a = ap.parse_args()
    if a.steps < 2 * INTERVAL:
        ap.error(f"--steps must be at least {2 * INTERVAL}")
    data_dir = a.dir or tempfile.mkdtemp(prefix="nanodist-prefetch-", dir="/var/tmp")
    out = tempfile.mkdtemp(prefix="nanodist-prefetch-runs-")
    try:
        os.makedirs(data_dir, exist_ok=True)
        train = os.path.join(data_dir, "train.bin")
        if not os.path.exists(train) or os.path.getsize(train) != a.gb << 30:
            make_tokens(train, a.gb)
        with open(train, "rb") as f, open(os.path.join(data_dir, "val.bin"), "wb") as v:
            v.write(f.read(1 << 20))
        # The first start on a new file scans its tokens (then cached): outside the timed runs, which would
        # otherwise begin with the whole file in the page cache.
        subprocess.run([a.nanodist, "check", os.path.join(ROOT, "config", "quickstart-char.toml"), "--set",
                        f"data_dir={json.dumps(data_dir)}"], cwd=ROOT, capture_output=True, check=True)
        print(f"| try | ms/step in place | ms/step prefetched | ratio | data ms/step in place | "
              f"data ms/step prefetched |")
        print("|---|---|---|---|---|---|")
        for k in range(a.repeats):
            (ms_off, d_off), (ms_on, d_on) = [run(a.nanodist, data_dir, out, p, a.steps) for p in (False, True)]
            print(f"| {k + 1} | {ms_off:.1f} | {ms_on:.1f} | {ms_on / ms_off:.2f}x | {d_off:.2f} | {d_on:.2f} |",
                  flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
