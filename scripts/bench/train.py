#!/usr/bin/env python3
"""Benchmark: training tokens/s and peak RSS of nanodist vs PyTorch nanoGPT on the same CPU.

Same model (nanoGPT's GPT-2, scripts/torch_parity.py), same batch and context, same total thread count, same
character-level Shakespeare (nanoGPT's shakespeare_char setting, which both configs below come from), AdamW. Runs alternate (nanodist, then PyTorch; erf-GELU and tanh-GELU for each)
and the median of several runs is printed with the ratio. nanodist runs twice per setting: one worker
with all the threads ("1xT"), and T local workers of one thread each splitting the same global batch
("Tx1": data parallel inside the process, the same update up to float summation order). Each run trains `--steps` steps; the first
`--warmup` steps are not timed.

    python3 scripts/bench/train.py [--runs 3] [--threads 2] [--configs cpu,medium]

Configs: cpu = nanoGPT's CPU config (n_layers 4, n_heads 4, n_embd 128, context 64, batch 12);
medium = (6, 6, 384, 256, 8). Installs torch into .venv when it is missing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    "cpu": dict(n_layers=4, n_heads=4, n_embd=128, context=64, batch=12, steps=60, warmup=10),
    "medium": dict(n_layers=6, n_heads=6, n_embd=384, context=256, batch=8, steps=16, warmup=4),
}

TORCH_RUN = r"""
import json, os, sys, time, resource
import numpy as np, torch
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
from torch_parity import GPT
cfg = json.loads(sys.argv[2])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
model = GPT(dict(n_layers=cfg["n_layers"], n_heads=cfg["n_heads"], n_embd=cfg["n_embd"], vocab_size=cfg["vocab"],
                 context_length=cfg["context"], bias=False, activation=cfg["activation"]))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
data = np.memmap(cfg["data"], dtype=np.uint16, mode="r")
rng = np.random.default_rng(0)
T, B = cfg["context"], cfg["batch"]
def batch():
    ix = rng.integers(0, len(data) - T - 1, B)
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
    return x, y
for step in range(cfg["steps"]):
    if step == cfg["warmup"]:
        start = time.perf_counter()
    x, y = batch()
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
secs = time.perf_counter() - start
print(json.dumps({"tokens_per_s": (cfg["steps"] - cfg["warmup"]) * B * T / secs, "loss": loss.item()}))
"""


def python_with_torch():
    try:
        import torch  # noqa: F401
        return sys.executable
    except ImportError:
        pass
    venv = os.path.join(ROOT, ".venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "--quiet", "torch", "numpy", "safetensors"], check=True)
    return py


def run_measured(cmd, **kw):
    """Runs cmd; returns (stdout, rusage of the child: ru_maxrss is its peak RSS in KB)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{err}")
    return out, usage


def run_nanodist(exe, c, act, workers, total_threads, vocab, data_dir, env):
    """One nanodist run: `workers` local workers of total_threads / workers threads; (tokens/s, peak RSS MB)."""
    with tempfile.TemporaryDirectory() as log:
        sets = [f"model.n_layers={c['n_layers']}", f"model.n_heads={c['n_heads']}",
                f"model.n_embd={c['n_embd']}", f"model.vocab_size={vocab}", f"model.activation={act}",
                f"train.context_length={c['context']}", f"train.global_batch_size={c['batch']}",
                f"train.local_batch_size={c['batch'] // workers}",
                f"train.n_steps={c['steps']}", "train.lr_schedule.warmup_steps=2",
                f"train.threads={total_threads // workers}", f"log.log_interval={c['warmup']}",
                f"log.eval_interval={c['steps']}", "log.eval_steps=1", "log.ckpt_interval=0",
                f"log_dir={log!r}".replace("'", '"'), 'log.run_name="bench"',
                f'data_dir="{data_dir}"']
        cmd = [exe, "train", os.path.join(ROOT, "config/gpt2-small.toml"), "--workers", str(workers)]
        for s in sets:
            cmd += ["--set", s]
        _, usage = run_measured(cmd, env=env)
        rows = [json.loads(l) for l in open(os.path.join(log, "bench/metrics.jsonl"))]
        # After the warm-up interval (the evaluation at step 0 and the first logged row are not timed).
        timed = [r["tokens_per_s"] for r in rows if r["step"] > c["warmup"]]
        return statistics.mean(timed), usage.ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="cpu,medium")
    args = ap.parse_args()
    data_dir = os.path.join(ROOT, "data/shakespeare_char")
    subprocess.run([os.path.join(ROOT, "scripts/fetch_corpus.sh")], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    exe = os.path.join(ROOT, "target/release/nanodist")
    if not os.path.exists(os.path.join(data_dir, "train.bin")):
        subprocess.run([exe, "prepare", "--input", os.path.join(ROOT, "data/corpus/shakespeare"), "--output",
                        data_dir, "--val-fraction", "0.1", "--tokenizer", "char"], check=True, stdout=subprocess.DEVNULL)
    vocab = json.load(open(os.path.join(data_dir, "meta.json")))["vocab_size"]
    py = python_with_torch()
    env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    print(f"threads {args.threads}, median of {args.runs} runs, tokens/s after warm-up steps, peak RSS in MB, "
          f"char vocabulary of {vocab}", flush=True)
    print(f"{'config':<8} {'impl':<27} {'tokens/s':>10} {'RSS MB':>8} {'vs torch erf':>13} {'vs torch tanh':>14}")
    for name in args.configs.split(","):
        c = CONFIGS[name]
        res = {}
        for _ in range(args.runs):
            for act in ("gelu", "gelu_tanh"):
                for workers in (1, args.threads):
                    key = f"nanodist {workers}x{args.threads // workers}"
                    res.setdefault((key, act), []).append(run_nanodist(exe, c, act, workers, args.threads,
                                                                       vocab, data_dir, env))
                cfg = dict(c, activation=act, threads=args.threads, vocab=vocab, data=os.path.join(data_dir, "train.bin"))
                out, usage = run_measured([py, "-c", TORCH_RUN, ROOT, json.dumps(cfg)], env=env)
                res.setdefault(("torch", act), []).append((json.loads(out)["tokens_per_s"], usage.ru_maxrss / 1024))
        med = {k: (statistics.median(t for t, _ in v), statistics.median(m for _, m in v)) for k, v in res.items()}
        impls = [f"nanodist 1x{args.threads}", f"nanodist {args.threads}x1", "torch"]
        for impl in impls:
            for act in ("gelu", "gelu_tanh"):
                if (impl, act) not in med:
                    continue
                tps, rss = med[(impl, act)]
                label = f"{impl} {'erf' if act == 'gelu' else 'tanh'}-GELU"
                print(f"{name:<8} {label:<27} {tps:>10.0f} {rss:>8.0f} {tps / med[('torch', 'gelu')][0]:>13.2f} "
                      f"{tps / med[('torch', 'gelu_tanh')][0]:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
