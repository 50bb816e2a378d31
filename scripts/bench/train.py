#!/usr/bin/env python3
"""Benchmark: training tokens/s, peak RSS and fraction of the CPU's GEMM peak of nanodist vs PyTorch nanoGPT.

Same model (nanoGPT's GPT-2, scripts/torch_parity.py), same batch and context, same total thread count, same
character-level Shakespeare, AdamW, tanh- or erf-GELU as the row says. The baseline is nanoGPT as it runs on
PyTorch >= 2.0: attention by F.scaled_dot_product_attention(is_causal=True) ("torch SDPA"); the materialized
T x T mask variant is an extra row ("torch mask", nanoGPT's fallback). nanodist runs with one worker and all the
threads ("1xT") and, on the small configs, T local workers of one thread each splitting the same global batch
("Tx1"). Runs alternate between the implementations; each row is the median of --runs runs, each training
`steps` steps of which the first `warmup` are not timed.

Mixed precision ("amp", `train.amp = true`: bf16 matmuls with f32 sums, f32 master weights) is a row of its own
for both: nanodist's linear layers, attention products and lm head in bf16; torch under torch.autocast("cpu", bfloat16), which is not
what nanoGPT runs on CPU (its train.py autocasts on CUDA only), so the ratio column stays against f32 torch SDPA.

The same run measures the machine's f32 GEMM peak with T threads (the best of numpy's BLAS, torch.mm and
nanodist's own gemm over square sizes 512-2048) and its bf16 GEMM peak (the better of torch.mm on bf16,
oneDNN's kernels, and nanodist's bf16 GEMM: `bench_bf16_gemm --squares`), and prints each row's
achieved FLOP/s (tokens/s x nanodist's FLOPs per token, the 6N + 12 L T C estimate nanoGPT's MFU uses) as a
fraction of the peak of the precision it ran in ("f32" or "bf16"; nanodist's amp rows train in f32 where
the plan says so, on CPUs whose bf16 products do not pay; on a CPU without bf16 units torch emulates bf16,
about 1% of its f32 rate, and its amp row is left out).

    python3 scripts/bench/train.py [--runs 3] [--threads 2] [--configs cpu,medium,gpt2]

Configs: cpu = nanoGPT's CPU config (n_layers 4, n_heads 4, n_embd 128, context 64, batch 12); medium = (6, 6,
384, 256, 8); gpt2 = the seed's GPT-2 small (12, 12, 768, context 1024, batch 1, vocabulary 50304), a few steps.
Installs torch into .venv/torch when it is missing.
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
    "gpt2": dict(n_layers=12, n_heads=12, n_embd=768, context=1024, batch=1, steps=6, warmup=2, vocab=50304),
}

GEMM_PEAK = r"""
import json, sys, time
import numpy as np, torch
torch.set_num_threads(int(sys.argv[1]))
best, bf16 = 0.0, 0.0
for n in (512, 1024, 2048):
    a = np.random.rand(n, n).astype(np.float32)
    b = np.random.rand(n, n).astype(np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ha, hb = ta.bfloat16(), tb.bfloat16()
    for half, mm in ((False, lambda: a @ b), (False, lambda: torch.mm(ta, tb)), (True, lambda: torch.mm(ha, hb))):
        mm()
        for _ in range(5):
            t = time.perf_counter()
            mm()
            f = 2 * n ** 3 / (time.perf_counter() - t)
            if half:
                bf16 = max(bf16, f)
            else:
                best = max(best, f)
print(json.dumps({"flops": best, "bf16": bf16}))
"""



def nanodist_gemm_peaks(threads, env):
    """nanodist's own GEMMs on the same squares (`bench_bf16_gemm --squares`): {"f32": GFLOP/s, "bf16":
    GFLOP/s or None without bf16 hardware}. A peak below the engine's own GEMM would put rows above 100%."""
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "bench_bf16_gemm"], cwd=ROOT,
                   check=True)
    exe = os.path.join(ROOT, "target/release/examples/bench_bf16_gemm")
    out = subprocess.run([exe, "--squares", "--threads", str(threads)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def python_with_torch():
    # Asked in a child: torch imported here would make this process ~0.5 GB, and Linux counts the RSS a
    # child had before its exec (this process's, forked) in the child's ru_maxrss.
    if subprocess.run([sys.executable, "-c", "import torch, numpy, safetensors"], capture_output=True).returncode == 0:
        return sys.executable
    venv = os.path.join(ROOT, ".venv", "torch")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if subprocess.run([py, "-c", "import torch, numpy, safetensors"], capture_output=True).returncode != 0:
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


def bf16_units():
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): elsewhere torch emulates bf16
    products, and a fraction of that rate says nothing, so the bf16 rows print none."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def nanodist_sets(c, act, workers, total_threads, vocab, data_dir, log):
    return [f"model.n_layers={c['n_layers']}", f"model.n_heads={c['n_heads']}",
            f"model.n_embd={c['n_embd']}", f"model.vocab_size={vocab}", f"model.activation={act}",
            f"train.context_length={c['context']}", f"train.global_batch_size={c['batch']}",
            f"train.local_batch_size={c['batch'] // workers}",
            f"train.n_steps={c['steps']}", "train.lr_schedule.warmup_steps=2",
            f"train.threads={total_threads // workers}", f"log.log_interval={c['warmup']}",
            f"log.eval_interval={c['steps']}", "log.eval_steps=1", "log.ckpt_interval=0",
            f"log_dir={log!r}".replace("'", '"'), 'log.run_name="bench"',
            f'data_dir="{data_dir}"']


def flops_per_token(exe, c, vocab, data_dir):
    """nanodist's training FLOPs per token of the config (`nanodist check`)."""
    cmd = [exe, "check", os.path.join(ROOT, "config/gpt2-small.toml"), "--workers", "1"]
    for s in nanodist_sets(c, "gelu", 1, 1, vocab, data_dir, "/tmp"):
        cmd += ["--set", s]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(next(l.split()[-1] for l in out.splitlines() if l.startswith("FLOPs per token")))


def run_nanodist(exe, c, act, workers, total_threads, vocab, data_dir, env, amp=False):
    """One nanodist run: `workers` local workers of total_threads / workers threads; (tokens/s, peak RSS MB)."""
    with tempfile.TemporaryDirectory() as log:
        cmd = [exe, "train", os.path.join(ROOT, "config/gpt2-small.toml"), "--workers", str(workers)]
        for s in nanodist_sets(c, act, workers, total_threads, vocab, data_dir, log) + [f"train.amp={str(amp).lower()}"]:
            cmd += ["--set", s]
        _, usage = run_measured(cmd, env=env)
        rows = [json.loads(l) for l in open(os.path.join(log, "bench/metrics.jsonl"))]
        # After the warm-up interval (the evaluation at step 0 and the first logged row are not timed).
        timed = [r["tokens_per_s"] for r in rows if r["step"] > c["warmup"]]
        # The plan names the CPU precision when the linear layers ran in bf16 (train.amp on a CPU whose
        # bf16 products pay); otherwise the run trained in f32.
        plan = open(os.path.join(log, "bench/plan.txt")).read()
        prec = "bf16" if "CPU precision" in plan else "f32"
        return statistics.mean(timed), usage.ru_maxrss / 1024, prec


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
    env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads),
           "OPENBLAS_NUM_THREADS": str(args.threads)}
    peaks = json.loads(subprocess.run([py, "-c", GEMM_PEAK, str(args.threads)], env=env, check=True,
                                      capture_output=True, text=True).stdout)
    ours = nanodist_gemm_peaks(args.threads, env)
    peak, f32_by = max((peaks["flops"], "numpy/torch BLAS"), (ours["f32"] * 1e9, "nanodist's gemm"))
    ours16 = [] if ours["bf16"] is None else [(ours["bf16"] * 1e9, "nanodist's bf16 GEMM")]
    peak16, bf16_by = max([(peaks["bf16"], "torch.mm")] + ours16)
    units = bf16_units()
    print(f"threads {args.threads}; GEMM peak of this machine with {args.threads} threads: f32 {peak / 1e9:.0f} GFLOP/s "
          f"({f32_by}; numpy/torch {peaks['flops'] / 1e9:.0f}, nanodist {ours['f32']:.0f}), "
          f"bf16 {peak16 / 1e9:.0f} GFLOP/s ({bf16_by}{'' if units else ', emulated: no bf16 units'}; torch.mm "
          f"{peaks['bf16'] / 1e9:.0f}, nanodist {'none' if ours['bf16'] is None else round(ours['bf16'])}), "
          f"512-2048 square; median of {args.runs} "
          f"alternating runs; tokens/s after the warm-up steps; peak RSS in MB; char data (vocabulary {vocab}; "
          f"gpt2: 50304); ratios against f32 torch SDPA (nanoGPT as it runs on CPU)", flush=True)
    print(f"{'config':<7} {'impl':<30} {'tokens/s':>9} {'vs torch SDPA':>14} {'of GEMM peak':>13} {'RSS MB':>7}")
    for name in args.configs.split(","):
        c = CONFIGS[name]
        v = c.get("vocab", vocab)
        fpt = flops_per_token(exe, c, v, data_dir)
        # (label, implementation, activation): the big config runs nanoGPT's default GELU only.
        acts = ("gelu",) if name == "gpt2" else ("gelu", "gelu_tanh")
        # (label, (implementation, workers or attention, amp), activation)
        rows = [(f"nanodist 1x{args.threads}", ("nanodist", 1, False), a) for a in acts]
        if name != "gpt2":
            rows.append((f"nanodist {args.threads}x1", ("nanodist", args.threads, False), "gelu_tanh"))
        rows += [(f"nanodist 1x{args.threads} amp", ("nanodist", 1, True), a) for a in acts]
        rows += [("torch SDPA", ("torch", "sdpa", False), a) for a in acts]
        rows.append(("torch mask", ("torch", "mask", False), acts[-1]))
        # Without bf16 units torch emulates bf16 products (about 1% of the f32 rate): the row would take
        # the whole run's time and compare nothing users run.
        if units:
            rows.append(("torch SDPA amp", ("torch", "sdpa", True), acts[-1]))
        res = {}
        for _ in range(args.runs):
            for label, (impl, how, amp), act in rows:
                if impl == "nanodist":
                    r = run_nanodist(exe, c, act, how, args.threads, v, data_dir, env, amp)
                else:
                    cfg = dict(c, activation=act, threads=args.threads, vocab=v, attention=how, amp=amp,
                               data=os.path.join(data_dir, "train.bin"))
                    out, usage = run_measured([py, os.path.join(ROOT, "scripts", "nanogpt_step.py"), json.dumps(cfg)], env=env)
                    r = (json.loads(out)["tokens_per_s"], usage.ru_maxrss / 1024, "bf16" if amp else "f32")
                res.setdefault((label, act), []).append(r)
        med = {k: (statistics.median(t for t, _, _ in v), statistics.median(m for _, m, _ in v), v[-1][2])
               for k, v in res.items()}
        for label, (_, _, amp), act in rows:
            tps, rss, prec = med[(label, act)]
            base = med[("torch SDPA", act)][0]
            text = f"{label} {'erf' if act == 'gelu' else 'tanh'}-GELU"
            frac = f"{tps * fpt / (peak16 if prec == 'bf16' else peak):.1%} {prec}"
            print(f"{name:<7} {text:<30} {tps:>9.0f} {tps / base:>13.2f}x {frac:>13} {rss:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
