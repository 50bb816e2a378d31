#!/usr/bin/env python3
"""Benchmark on the GPUs of this machine (the speed section of scripts/gpu-selftest.sh); one table out.

1. GPT-2 small (the seed config config/gpt2-small.toml, shortened: --steps steps, batch --batch x 1024) on one
   GPU: nanodist (train.device = "cuda", bf16 matmuls as the seed's amp = true) against PyTorch nanoGPT (the
   same GPT of scripts/torch_parity.py with F.scaled_dot_product_attention(is_causal=True), bf16 autocast,
   fused AdamW, TF32 matmuls, as nanoGPT's train.py runs it; and torch.compile'd, nanoGPT's default, where
   it compiles). Tokens/s after the warm-up steps, and MFU: tokens/s x FLOPs per token (nanodist's
   6N + 12 L T C estimate, the one nanoGPT's MFU uses) over the GPU's dense bf16 peak.
2. Per sync backend, ms per step at world size = the GPU count (the NCCL engine under mpirun, one rank per
   GPU), on the same model and batch per GPU.

    python3 scripts/bench/gpu.py [--steps 30] [--warmup 10] [--batch 12] [--backends allreduce,gossip-ring,...]

Needs a built target/release/nanodist with --features cuda,mpi (gpu-selftest.sh builds it), the character data
of data/shakespeare_char, and, for the PyTorch rows, a CUDA PyTorch (rows say why when it is missing).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import TORCH_RUN, flops_per_token  # noqa: E402  (nanoGPT's step; nanodist's FLOPs per token)

# Dense bf16 peaks (no sparsity) by the name nvidia-smi prints, from NVIDIA's data sheets.
BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}

GPT2 = dict(n_layers=12, n_heads=12, n_embd=768, context=1024, vocab=50304)

BACKENDS = {
    "allreduce": [],
    "gossip-ring": ["train.backend=\"decentdp\"", "train.topology=\"ring\""],
    "gossip-exp": ["train.backend=\"decentdp\"", "train.topology=\"exp\""],
    "topk": ["train.compression={name=\"topk\",density=0.01}"],
    "powersgd": ["train.compression={name=\"powersgd\",rank=4,start_iter=2}"],
    "diloco": ["train.backend=\"diloco\"", "train.diloco={sync_every=5}"],
}



def gpus():
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()
    return names


def peak_of(name):
    return next((p for key, p in BF16_PEAK.items() if key in name), None)


def sets(a, log, steps, warmup):
    c = GPT2
    return [f"model.vocab_size={c['vocab']}", f"train.context_length={c['context']}",
            f"train.local_batch_size={a.batch}", f"train.n_steps={steps}", "train.lr_schedule.warmup_steps=2",
            "train.device=\"cuda\"", "train.amp=true", f"log.log_interval={warmup}", f"log.eval_interval={steps}",
            "log.eval_steps=1", "log.ckpt_interval=0", "log.eval_at_start=false", "log.wandb_log=false",
            f"log_dir=\"{log}\"", "log.run_name=\"bench\"", f"data_dir=\"{a.data}\""]


def nanodist(a, world, extra):
    """Tokens/s per rank of a nanodist run on `world` GPUs (rows after the warm-up interval)."""
    with tempfile.TemporaryDirectory() as log:
        cmd = [a.exe, "train", os.path.join(ROOT, "config/gpt2-small.toml")]
        args = sets(a, log, a.steps, a.warmup) + [f"train.global_batch_size={a.batch * world}"] + extra
        if world > 1:
            cmd = ["mpirun", "--oversubscribe", "-np", str(world)] + cmd
            args.append("train.engine=\"nccl\"")
        for s in args:
            cmd += ["--set", s]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            return None, (p.stderr.strip().splitlines() or ["failed"])[-1]
        rows = [json.loads(l) for l in open(os.path.join(log, "bench/metrics.jsonl"))]
        timed = [r["tokens_per_s"] for r in rows if r["step"] > a.warmup and r.get("tokens_per_s")]
        return statistics.mean(timed) / world, None


def torch_run(a, compile_):
    cfg = dict(GPT2, batch=a.batch, steps=a.steps, warmup=a.warmup, compile=compile_, device="cuda", threads=4,
               activation="gelu", attention="sdpa", data=os.path.join(a.data, "train.bin"))
    p = subprocess.run([a.python, "-c", TORCH_RUN, ROOT, json.dumps(cfg)], capture_output=True, text=True)
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(p.stdout)["tokens_per_s"], None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--exe", default=os.path.join(ROOT, "target/release/nanodist"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data/shakespeare_char"))
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args()
    names = gpus()
    peak = peak_of(names[0])
    fpt = flops_per_token(a.exe, dict(GPT2, batch=a.batch, steps=a.steps, warmup=a.warmup), GPT2["vocab"], a.data)
    print(f"{len(names)} x {names[0]}; dense bf16 peak {peak / 1e12:.0f} TFLOP/s" if peak else
          f"{len(names)} x {names[0]}; bf16 peak unknown (MFU not printed)")
    print(f"GPT-2 small, batch {a.batch} x 1024 per GPU, {a.steps} steps ({a.warmup} warm-up), "
          f"{fpt / 1e9:.2f} GFLOP per token")
    print(f"{'run':<40} {'tokens/s/GPU':>13} {'MFU':>7} {'ms/step':>9}")

    def row(label, tps, why):
        if tps is None:
            print(f"{label:<40} not run: {why}")
            return
        mfu = f"{tps * fpt / peak:.1%}" if peak else "-"
        print(f"{label:<40} {tps:>13.0f} {mfu:>7} {1000 * a.batch * 1024 / tps:>9.1f}", flush=True)

    row("nanodist, 1 GPU, bf16 matmuls", *nanodist(a, 1, []))
    row("PyTorch nanoGPT SDPA, bf16 autocast", *torch_run(a, False))
    row("PyTorch nanoGPT SDPA, bf16, compiled", *torch_run(a, True))
    for name in a.backends.split(","):
        row(f"nanodist {name}, {len(names)} GPU(s)", *nanodist(a, len(names), BACKENDS[name]))


if __name__ == "__main__":
    main()
