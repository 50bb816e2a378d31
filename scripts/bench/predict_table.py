#!/usr/bin/env python3
"""Predicted ms/step of the seed GPT-2 small configs (config/gpt2-small.toml, config/decent-gpt2-small.toml)
at 16 and 32 GPUs, 4 per node, on every built-in cluster profile: all-reduce (PyTorch DDP), each gossip
topology synchronous and overlapped, Radius stable top-k and PowerSGD, with the speed-up over all-reduce.
Prints a Markdown table (`nanodist predict ... --json` for each cell).

    python3 scripts/bench/predict_table.py [--nanodist target/release/nanodist]
"""
import argparse
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = ["a40-25gbe", "a100-ib100", "h100-ib400", "t4-ib", "wan-1g"]
DDP = os.path.join(ROOT, "config", "gpt2-small.toml")
GOSSIP = os.path.join(ROOT, "config", "decent-gpt2-small.toml")
METHODS = [
    ("all-reduce", DDP, []),
    ("ring", GOSSIP, ['train.topology="ring"', "train.overlap=false"]),
    ("ring overlap", GOSSIP, ['train.topology="ring"', "train.overlap=true"]),
    ("exp", GOSSIP, ['train.topology="exp"', "train.overlap=false"]),
    ("exp overlap", GOSSIP, ['train.topology="exp"', "train.overlap=true"]),
    ("alt-exp-ring", GOSSIP, ["train.overlap=false"]),
    ("alt-exp-ring overlap", GOSSIP, ["train.overlap=true"]),
    ("Radius", DDP, ['train.compression={ name = "radius" }']),
    ("PowerSGD r4", DDP, ['train.compression={ name = "powersgd", rank = 4 }']),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanodist", default=os.path.join(ROOT, "target", "release", "nanodist"))
    ap.add_argument("--gpus", type=int, nargs="+", default=[16, 32])
    a = ap.parse_args()
    print("| cluster | GPUs | " + " | ".join(m[0] for m in METHODS) + " |")
    print("|---|---|" + "---|" * len(METHODS))
    for cluster in CLUSTERS:
        for gpus in a.gpus:
            cells, base = [], None
            for name, config, sets in METHODS:
                # The seed's 480-sequence global batch, split over the GPUs.
                cmd = [a.nanodist, "predict", config, "--cluster", cluster, "--workers", str(gpus),
                       "--ranks-per-node", "4", "--json", "--set", f"train.local_batch_size={480 // gpus}"]
                for s in sets:
                    cmd += ["--set", s]
                out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
                ms = json.loads(out.stdout)["ms_per_step"]
                base = base or ms
                cells.append(f"{ms:.0f}" if name == "all-reduce" else f"{ms:.0f} ({base / ms:.2f}x)")
            print(f"| {cluster} | {gpus} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
