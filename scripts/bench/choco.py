#!/usr/bin/env python3
"""Compressed gossip (CHOCO-SGD) quality table: the quick-start model (config/quickstart-char.toml) on 8
local workers with a global batch of 16 sequences, trained by all-reduce, by uncompressed gossip on ring
and exp, and by CHOCO on ring and exp with each compressor at two settings (sign has none), the consensus
step tuned by "auto". Prints, per run: topology, compressor, gamma, final val loss and its change against
uncompressed gossip on the same topology, the consensus distance at the final evaluation, and the mean
bytes sent per worker per step (rank 0's count) with its fraction of uncompressed gossip's.

    python3 scripts/bench/choco.py [--steps 600] [--workers 8] [--only WORD ...]

`--only` keeps the compressed runs whose compressor names one of the words (the baselines always run).

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

COMPRESSORS = [
    ("top-k 1%", '{ name = "topk", density = 0.01, consensus_step = "auto" }'),
    ("top-k 10%", '{ name = "topk", density = 0.1, consensus_step = "auto" }'),
    ("random-k 1%", '{ name = "randomk", density = 0.01, consensus_step = "auto" }'),
    ("random-k 10%", '{ name = "randomk", density = 0.1, consensus_step = "auto" }'),
    ("qsgd 1 level (2 bits)", '{ name = "qsgd", levels = 1, consensus_step = "auto" }'),
    ("qsgd 15 levels (5 bits)", '{ name = "qsgd", levels = 15, consensus_step = "auto" }'),
    ("sign (1 bit)", '{ name = "sign", consensus_step = "auto" }'),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=[])
    a = ap.parse_args()
    exe = os.path.join(ROOT, "target", "release", "nanodist")
    out = tempfile.mkdtemp(prefix="nanodist-choco-")
    atexit.register(shutil.rmtree, out, True)  # runs leave GBs of checkpoints
    runs = [("-", "all-reduce", [])]
    for topo in ["ring", "exp"]:
        gossip = ['train.backend="decentdp"', f'train.topology="{topo}"']
        runs.append((topo, "none (gossip)", gossip))
        runs += [(topo, name, gossip + [f"train.compression={c}"]) for name, c in COMPRESSORS
                 if not a.only or any(w in name for w in a.only)]
    table, base = [], {}
    for topo, name, sets in runs:
        run = f"{topo}-{name}".replace(" ", "_").replace("%", "").replace("(", "").replace(")", "")
        cmd = [exe, "train", os.path.join(ROOT, "config", "quickstart-char.toml"), "--workers", str(a.workers),
               "--set", "train.global_batch_size=16", "--set", f"train.n_steps={a.steps}",
               "--set", f"log.eval_interval={a.steps}", "--set", "log.ckpt_interval=0",
               "--set", f"log.log_interval={max(1, a.steps // 10)}",
               "--set", f"log_dir={json.dumps(out)}", "--set", f'log.run_name="{run}"']
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
        last = rows[-1]
        per_step = sum(r["comm_bytes"] for r in rows if r["step"] > 0) / a.steps
        if name == "none (gossip)":
            base[topo] = (last["val_loss"], per_step)
        table.append((topo, name, last.get("consensus_step"), last["val_loss"], last.get("consensus_distance"),
                      per_step))
        print(f"done: {topo} {name}", flush=True)
    print(f"\nquick-start model, {a.workers} workers, global batch 16 x 64 tokens, {a.steps} steps")
    print("| topology | compressor | gamma | final val loss | vs gossip | consensus distance | bytes/step/worker "
          "| vs gossip |")
    print("|---|---|---|---|---|---|---|---|")
    for topo, name, gamma, val, dist, b in table:
        g = f"{gamma:.4f}" if gamma is not None else "-"
        d = f"{dist:.3g}" if dist is not None else "-"
        if topo in base:
            rel = f"{100 * (val / base[topo][0] - 1):+.1f}%"
            frac = f"{b / base[topo][1]:.3f}x"
        else:
            rel, frac = "-", "-"
        print(f"| {topo} | {name} | {g} | {val:.4f} | {rel} | {d} | {b / 1e6:.4f} MB | {frac} |")


if __name__ == "__main__":
    main()
