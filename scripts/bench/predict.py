#!/usr/bin/env python3
"""Checks `nanodist predict` against real `mpirun` runs on this machine: calibrates the MPI engine
(`nanodist calibrate --engine mpi`) into a profile, trains the quick-start model and one 4x larger
(16 layers) with -np 2 and -np 4 by all-reduce, ring and exp gossip, PowerSGD and top-k, and prints each
run's measured ms/step (median over its metrics rows after the first) beside the prediction from its run
directory on that profile. Each row's bound is --tolerance plus twice the run's own spread (the
interquartile range of its rows' ms/step over their median): a run whose steps scatter, as ranks that share
cores do, is measured no better than that. Exits 1 when more than one row in ten (--outliers) is past its
bound, or any row is past 1.5 times it: this machine's own speed drifts by a third between minutes (the
quick-start all-reduce at -np 2 measured 38 ms in one try and 52 ms in the next), which no model of the
calibrated machine follows; a wrong model puts many rows past their bounds.

    python3 scripts/bench/predict.py [--nanodist target/release/nanodist] [--data data/shakespeare_char]

tests/it/predict.rs runs it (on synthetic data, debug build) and asserts the tolerance.
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The 4x model is 4x deeper: at 4x the width a CPU runs ~1.4x more FLOP/s, which one MFU cannot follow.
MODELS = [("quick-start", []), ("4x (16 layers)", ["model.n_layers=16"])]
ALGORITHMS = [
    ("all-reduce", []),
    ("ring gossip", ['train.backend="decentdp"', 'train.topology="ring"']),
    ("exp gossip", ['train.backend="decentdp"', 'train.topology="exp"']),
    ("PowerSGD r4", ['train.compression={ name = "powersgd", rank = 4 }']),
    ("top-k 1%", ['train.compression={ name = "topk", density = 0.01 }']),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanodist", default=os.path.join(ROOT, "target", "release", "nanodist"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "shakespeare_char"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tolerance", type=float, default=0.30)
    ap.add_argument("--outliers", type=float, default=0.10, help="the fraction of rows allowed past their bound")
    a = ap.parse_args()
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    # calibrate passes Open MPI's root override itself (and says so): called without it here.
    cal_env = {k: v for k, v in env.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = tempfile.mkdtemp(prefix="nanodist-predict-")
    atexit.register(shutil.rmtree, out, True)  # runs leave GBs of checkpoints
    profile = os.path.join(out, "local.toml")
    cal = subprocess.run([a.nanodist, "calibrate", "--engine", "mpi", "--output", profile], env=cal_env,
                         cwd=ROOT, check=True, capture_output=True, text=True)
    if os.geteuid() == 0:
        assert "OMPI_ALLOW_RUN_AS_ROOT=1" in cal.stderr, cal.stderr
    print(cal.stdout.strip(), flush=True)
    rows = []
    for model, msets in MODELS:
        for np_ in a.ranks:
            for alg, asets in ALGORITHMS:
                run = f"{model}-{np_}-{alg}".replace(" ", "_").replace("(", "").replace(")", "").replace("%", "")
                sets = [f"log_dir={json.dumps(out)}", f'log.run_name="{run}"', f"data_dir={json.dumps(a.data)}",
                        f"train.n_steps={a.steps}", "train.lr_schedule.warmup_steps=5", "log.log_interval=10",
                        f"log.eval_interval={10 * a.steps}", "log.ckpt_interval=0", "train.threads=1",
                        'train.engine="mpi"'] + msets + asets
                cmd = ["mpirun", "--oversubscribe", "-np", str(np_), a.nanodist, "train",
                       os.path.join(ROOT, "config", "quickstart-char.toml")]
                for s in sets:
                    cmd += ["--set", s]
                subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True)
                metrics = [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl"))]
                # Trained rows after the first (the evaluation at step 0 trains nothing; the first row warms up).
                trained = [m for m in metrics if m["step"] > 0]
                times = sorted(m["ms_per_step"] for m in trained[1:])
                measured = times[len(times) // 2]
                spread = (times[3 * len(times) // 4] - times[len(times) // 4]) / measured
                pred = subprocess.run([a.nanodist, "predict", os.path.join(out, run), "--cluster", profile,
                                       "--ranks-per-node", str(np_), "--json"], env=env, cwd=ROOT, check=True,
                                      capture_output=True, text=True)
                predicted = json.loads(pred.stdout)["ms_per_step"]
                err = predicted / measured - 1
                bound = a.tolerance + 2 * spread
                rows.append((model, np_, alg, measured, predicted, err, spread, bound))
                print(f"{model}, -np {np_}, {alg}: measured {measured:.1f} ms (spread {100 * spread:.0f}%), "
                      f"predicted {predicted:.1f} ms ({100 * err:+.1f}%, bound {100 * bound:.0f}%)", flush=True)
    print("\n| model | ranks | algorithm | measured ms/step | spread | predicted ms/step | error | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for model, np_, alg, m, p, e, sp, b in rows:
        print(f"| {model} | {np_} | {alg} | {m:.1f} | {100 * sp:.0f}% | {p:.1f} | {100 * e:+.1f}% | {100 * b:.0f}% |")
    fails = [r for r in rows if abs(r[5]) > r[7]]
    far = [r for r in rows if abs(r[5]) > 1.5 * r[7]]
    allowed = int(a.outliers * len(rows))
    print(f"\n{len(fails)} of {len(rows)} rows past their bound (--tolerance {100 * a.tolerance:.0f}% + 2 x spread; "
          f"{allowed} allowed), {len(far)} past 1.5 times it (none allowed)")
    sys.exit(0 if len(fails) <= allowed and not far else 1)


if __name__ == "__main__":
    main()
