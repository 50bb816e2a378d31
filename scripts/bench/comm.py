#!/usr/bin/env python3
"""Communication table: per-step time split (compute vs communication) and bytes sent per worker per step,
for each backend and topology at 4 and 8 workers, next to the theoretical volume:
  - all-reduce (ring / reduce-scatter + all-gather): 2 (N - 1) / N x model bytes;
  - gossip: peers x model bytes when each peer is sent the whole model (Decent-DP's point-to-point view);
    nanodist mixes a group of g ranks by a group all-reduce, 2 (g - 1) / g x model, shown as well.

    python3 scripts/bench/comm.py [--steps 40] [--workers 4 8] [--engine local|mpi]

Needs ./target/release/nanodist (cargo build --release [--features mpi]) and data/shakespeare_char
(scripts/quickstart.sh). Communication time counts time inside collectives, waiting for slower ranks
included; with more workers than cores the compute share is inflated by oversubscription.
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cases(n):
    """(label, --set overrides, groups per round: the list of group sizes this rank sees, cycled)."""
    per_node = 2
    nodes = n // per_node
    k = nodes.bit_length() - 1
    out = [
        ("allreduce", ["train.backend=pytorchddp"], None),
        ("gossip complete", ["train.backend=decentdp", "train.topology=complete"], [n]),
        ("gossip ring", ["train.backend=decentdp", "train.topology=ring"], [2, 2]),
        ("gossip ring overlap", ["train.backend=decentdp", "train.topology=ring", "train.overlap=true"], [2, 2]),
        ("gossip exp", ["train.backend=decentdp", "train.topology=exp"], [2] * (n.bit_length() - 1)),
        (f"gossip alt-exp-ring ({per_node}/node)",
         ["train.backend=decentdp", "train.topology=alternating-exp-ring", f"train.ranks_per_node={per_node}"],
         [per_node, 2 * per_node] * k),
    ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--engine", choices=["local", "mpi"], default="local")
    a = ap.parse_args()
    exe = os.path.join(ROOT, "target", "release", "nanodist")
    out = tempfile.mkdtemp(prefix="nanodist-comm-")
    atexit.register(shutil.rmtree, out, True)  # runs leave GBs of checkpoints
    table = []
    for n in a.workers:
        for label, sets, groups in cases(n):
            run = f"n{n}-" + label.replace(" ", "-").replace("/", "").replace("(", "").replace(")", "")
            args = ["train", os.path.join(ROOT, "config", "quickstart-char.toml"),
                    "--set", f"train.n_steps={a.steps}", "--set", "train.lr_schedule.warmup_steps=2",
                    "--set", f"log.eval_interval={a.steps}",
                    "--set", "log.eval_steps=1", "--set", "log.log_interval=1", "--set", "log.ckpt_interval=0",
                    "--set", f"train.global_batch_size={2 * n}", "--set", "train.local_batch_size=2",
                    "--set", "train.threads=1", "--set", f"log_dir={json.dumps(out)}",
                    "--set", f'log.run_name="{run}"']
            for s in sets:
                args += ["--set", s]
            if a.engine == "mpi":
                cmd = ["mpirun", "--oversubscribe", "-np", str(n), exe] + args + ["--set", "train.engine=mpi"]
                env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            else:
                cmd = [exe] + args + ["--workers", str(n)]
                env = None
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
            rows = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
            rows = [r for r in rows if r["step"] > 5 and "val_loss" not in r]  # steady state, no eval
            ms = sum(r["ms_per_step"] for r in rows) / len(rows)
            comm = sum(r["comm_ms"] for r in rows) / len(rows)
            sent = sum(r["comm_bytes"] for r in rows) / len(rows)
            table.append((n, label, groups, ms, comm, sent))
            print(f"done: {n} {label}", flush=True)
    # Model size in bytes: from the plan nanodist prints.
    plan = subprocess.run([exe, "check", os.path.join(ROOT, "config", "quickstart-char.toml")],
                          cwd=ROOT, check=True, capture_output=True, text=True).stdout
    params = int(next(l for l in plan.splitlines() if l.startswith("parameters")).split()[1])
    model = 4 * params
    print(f"\nengine {a.engine}, quick-start model ({params} parameters, {model / 1e6:.2f} MB), local batch 2, "
          f"{a.steps} steps (steady-state means over steps 6..)")
    print("| workers | backend | ms/step | compute ms | comm ms (share) | sent MB/step | theory MB/step (peers x model) | theory, group all-reduce |")
    print("|---|---|---|---|---|---|---|---|")
    for n, label, groups, ms, comm, sent in table:
        if groups is None:
            theory = 2 * (n - 1) / n * model
            peers = theory
        else:
            theory = sum(2 * (g - 1) / g * model for g in groups) / len(groups)
            peers = sum((g - 1) * model for g in groups) / len(groups)
        print(f"| {n} | {label} | {ms:.1f} | {ms - comm:.1f} | {comm:.1f} ({100 * comm / ms:.0f}%) | "
              f"{sent / 1e6:.3f} | {peers / 1e6:.3f} | {theory / 1e6:.3f} |")


if __name__ == "__main__":
    main()
