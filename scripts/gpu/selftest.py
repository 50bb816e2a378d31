#!/usr/bin/env python3
"""nanodist's GPU self-test: every GPU check in one command of at most ten minutes, from the bundle that
scripts/gpu-bundle.sh builds (this file is its selftest.py). It needs the bundle, a GPU with a CUDA 13
driver, and the CUDA, cuBLAS and NCCL libraries of the machine (a CUDA toolkit or PyTorch's Python wheels);
no Rust, no network and no mpirun.

    python3 .gpu-bundle/selftest.py [--out DIR] [--ranks N] [--budget SECONDS] [--only STEP,...] [--list]

Steps, each bounded in time (the whole run stays within --budget; a step that no longer fits says so):
  probe        the GPU (nvidia-smi): name, compute capability, driver, memory
  libraries    each library the binaries need, found on this machine; LD_LIBRARY_PATH for the rest;
               both binaries start (every symbol bound)
  kernels      tests/gpu.rs: each reducer, optimizer and model kernel against its CPU twin, bit for bit (the
               softmax and cross-entropy within 1e-6 and 2e-6: the GPU's expf and logf); the NCCL engine at
               world size 1; each backend's GPU state against its host path
  ops          the GPU time of each piece of a GPT-2 small step (batch 12 x 1024, bf16 matmuls) timed alone,
               forward and backward, times its count a step, the largest first, with its rate (TFLOP/s or
               GB/s); and the whole model's loss and backward (tests/gpu.rs `op_times`; needs no ncu)
  nccl         `nanodist train` on the NCCL engine at world 1, 2 and --ranks: N processes on the one GPU,
               NCCL's id over TCP (MASTER_ADDR/MASTER_PORT), each rank its own NCCL host id so that NCCL
               connects ranks of one GPU through its socket transport
  backends     per sync backend, --ranks GPU ranks against --ranks CPU workers of the same seed: train loss
               within 2% at every logged step
  checkpoints  a GPU run's checkpoint resumed on the CPU and a CPU run's on the GPU, against the same
               checkpoint resumed on its own device (train loss within 1e-3)
  speed        GPT-2 small on one GPU: nanodist's tokens/s and MFU against PyTorch nanoGPT (SDPA, bf16
               autocast; compiled where time allows); each backend's ms/step with 2 ranks on the GPU
  profile      where nanodist's GPT-2 small run spends the GPU's time: ncu's time of each of its first
               kernels (its start and first step), summed by kernel name, the largest first (skipped without ncu)

The table is printed and written to DIR/selftest.md and DIR/selftest.json (DIR: --out, else $OUT, else
./selftest-out), with the logs of every run in DIR/logs.tar.gz. Exit status: 0 when every check passed,
1 when one failed, 2 for bad arguments or a bundle that is not whole.

--fake-gpu "NAME;CAPABILITY;DRIVER" and --lib-root DIR replace the GPU probe and the library search roots,
so that the parts that need no GPU (arguments, library discovery, the table) run anywhere (CI does).
"""
import argparse
import glob
import json
import lzma
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Libraries every Linux machine has; the others must be found.
SYSTEM = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libstdc++.so.6", "libdl.so.2", "libpthread.so.0",
          "librt.so.1", "ld-linux-x86-64.so.2"}
SYSTEM_DIRS = {"/lib", "/lib64", "/usr/lib", "/usr/lib64", "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"}
# Dense bf16 peaks (no sparsity) by the name nvidia-smi prints, from NVIDIA's data sheets.
BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
GPT2 = dict(n_layers=12, n_heads=12, n_embd=768, context=1024, vocab=50304)
# name -> --set overrides, for the loss comparison against the CPU and the speed rows.
BACKENDS = {
    "allreduce": [],
    "gossip-ring": ['train.backend="decentdp"', 'train.topology="ring"'],
    "gossip-exp-overlap": ['train.backend="decentdp"', 'train.topology="exp"', "train.overlap=true"],
    "topk": ['train.compression={name="topk",density=0.1}'],
    "radius": ['train.compression={name="radius",density=0.1,interval=10,threshold=10}'],
    "powersgd": ['train.compression={name="powersgd",rank=4,start_iter=10}'],
    "choco-topk": ['train.backend="decentdp"', 'train.topology="ring"',
                   'train.compression={name="topk",density=0.1}'],
    "diloco": ['train.backend="diloco"', "train.diloco={sync_every=10}"],
    "streaming-diloco-fp8": ['train.backend="diloco"',
                             'train.diloco={sync_every=10,fragments=2,fragment_delay=2,quantize="fp8"}'],
    "sparta": ['train.backend="sparta"', "train.sparta={p=0.05}"],
    "demo": ['train.backend="demo"', 'train.optim={name="sgd",weight_decay=0.01}'],
    "amp-bf16": ["train.amp=true"],
}
SPEED_BACKENDS = ["allreduce", "gossip-ring", "topk", "powersgd", "diloco", "demo"]


class Bad(Exception):
    """A bundle or argument problem: exit 2."""


class Runner:
    """Runs commands with time limits inside the budget and collects the table's rows."""

    def __init__(self, a, out):
        self.a, self.out = a, out
        self.deadline = time.monotonic() + a.budget
        self.rows = []
        self.work = tempfile.mkdtemp(prefix="nanodist-selftest-")
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs)
        self.env = dict(os.environ)
        self.gpu = None

    def left(self):
        return self.deadline - time.monotonic()

    def row(self, check, result, detail="", secs=None):
        self.rows.append(dict(check=check, result=result, detail=detail, seconds=secs))
        print(f"{result:<5} {check}: {detail}" + (f" ({secs:.1f} s)" if secs is not None else ""), flush=True)

    def start(self, cmd, name, env=None, cwd=None):
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or self.env, cwd=cwd,
                                start_new_session=True)

    def wait(self, procs, limit):
        """Waits for every process until `limit` seconds have passed (or the budget ends); kills the rest.
        Returns (exit codes, None for killed ones; seconds)."""
        t0 = time.monotonic()
        end = min(t0 + limit, self.deadline)
        codes = [None] * len(procs)
        while any(c is None for c in codes) and time.monotonic() < end:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):  # one rank failed: the others cannot finish
                break
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if codes[i] is None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            elif codes[i] is None:
                codes[i] = p.returncode
        return codes, time.monotonic() - t0

    def run(self, cmd, name, limit, env=None):
        codes, secs = self.wait([self.start(cmd, name, env)], limit)
        return codes[0], secs

    def last_line(self, name):
        try:
            lines = [l.strip() for l in open(os.path.join(self.logs, f"{name}.log")) if l.strip()]
        except OSError:
            return ""
        errors = [l for l in lines if "error" in l.lower() or "panicked" in l]
        return (errors or lines or [""])[-1][:300]


def why(code, secs, r, name):
    if code is None:
        return f"timed out after {secs:.0f} s; {r.last_line(name)}"
    return f"exit {code}: {r.last_line(name)}"


# ---------------------------------------------------------------------------------------------- steps


def unpack(r):
    """The binaries, decompressed into the work folder (the bundle ships them as .xz)."""
    r.bin = os.path.join(r.work, "bin")
    os.makedirs(r.bin, exist_ok=True)
    for b in ("nanodist", "gpu-tests"):
        src = os.path.join(r.bundle, "bin", f"{b}.xz")
        if not os.path.exists(src):
            raise Bad(f"{src} is missing: rebuild the bundle with scripts/gpu-bundle.sh")
        with lzma.open(src) as f, open(os.path.join(r.bin, b), "wb") as g:
            shutil.copyfileobj(f, g, 1 << 20)
        os.chmod(os.path.join(r.bin, b), 0o755)


def probe(r):
    if r.a.fake_gpu:
        name, cap, driver = (r.a.fake_gpu.split(";") + ["", ""])[:3]
        r.gpu = dict(name=name, cap=cap, driver=driver, memory="")
        r.row("probe", "PASS", f"fake GPU: {name}, compute capability {cap}, driver {driver}")
        return
    if not shutil.which("nvidia-smi"):
        raise Bad("no nvidia-smi: this machine shows no NVIDIA driver")
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    lines = [l for l in q.stdout.strip().splitlines() if l.strip()]
    if q.returncode != 0 or not lines:
        r.row("probe", "FAIL", f"nvidia-smi: {(q.stderr or q.stdout).strip()[:200]}")
        return
    name, cap, driver, mem = [x.strip() for x in lines[0].split(",")]
    r.gpu = dict(name=name, cap=cap, driver=driver, memory=mem, count=len(lines))
    ok = int(driver.split(".")[0]) >= 580
    r.row("probe", "PASS" if ok else "FAIL", f"{len(lines)} x {name}, compute capability {cap}, driver {driver}, "
          f"{mem}" + ("" if ok else "; this build needs a CUDA 13 driver (R580 or newer)"))


def search_roots(a):
    if a.lib_root:
        return a.lib_root
    roots = []
    for py in dict.fromkeys(filter(None, [sys.executable, shutil.which("python3"), "/opt/torch/.venv/bin/python3"])):
        if os.path.exists(py):
            q = subprocess.run([py, "-c", "import site, json; print(json.dumps(site.getsitepackages()))"],
                               capture_output=True, text=True)
            if q.returncode == 0:
                roots += [os.path.join(s, "nvidia") for s in json.loads(q.stdout)]
    roots += ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/local/cuda/lib64",
              "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"]
    return [d for d in dict.fromkeys(roots) if os.path.isdir(d)]


def ldconfig():
    """soname -> path, from the dynamic linker's cache."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    found = {}
    for line in out.splitlines():
        if "=>" in line and "x86-64" in line:
            name, path = line.split("=>")
            found.setdefault(name.split()[0], path.strip())
    return found


def find(soname, roots, cache):
    # The driver's library comes from the driver (the dynamic linker's cache or its folder), never from a
    # toolkit's link-time stubs or its forward-compatibility copy.
    def usable(p):
        return "/stubs/" not in p and "/compat/" not in p
    if soname == "libcuda.so.1" and soname in cache and usable(cache[soname]):
        return cache[soname]
    for root in roots:
        hits = sorted(p for p in glob.glob(os.path.join(root, "**", soname), recursive=True) if usable(p))
        if hits:
            return hits[0]
    return cache[soname] if soname in cache and usable(cache[soname]) else None


def libraries(r):
    needed = [n for n in r.manifest["needed"] if n not in SYSTEM]
    roots = search_roots(r.a)
    cache = {} if r.a.lib_root else ldconfig()
    dirs, missing = [], []
    for soname in needed:
        path = find(soname, roots, cache)
        if path:
            r.row(f"library {soname}", "PASS", path)
            d = os.path.dirname(path)
            if d not in SYSTEM_DIRS and d not in dirs:
                dirs.append(d)
        else:
            missing.append(soname)
            r.row(f"library {soname}", "FAIL", f"not found under {', '.join(roots) or 'no search root'}"
                  " (install the CUDA 13 toolkit, or PyTorch's CUDA 13 wheels: nvidia-cublas, nvidia-nccl-cu13, ...)")
    path = ":".join(dirs + [p for p in r.env.get("LD_LIBRARY_PATH", "").split(":") if p])
    r.env["LD_LIBRARY_PATH"] = path
    r.row("LD_LIBRARY_PATH", "INFO", path or "(system folders only)")
    if missing or r.a.fake_gpu:
        return
    for b in ("nanodist", "gpu-tests"):
        code, secs = r.run([os.path.join(r.bin, b), "--help"], f"load-{b}", 30)
        r.row(f"{b} starts (every symbol bound)", "PASS" if code == 0 else "FAIL",
              "" if code == 0 else why(code, secs, r, f"load-{b}"), secs)


def kernels(r, limit):
    name = "gpu-tests"
    code, secs = r.run([os.path.join(r.bin, "gpu-tests"), "--test-threads=1"], name, limit)
    results = {}
    for line in open(os.path.join(r.logs, f"{name}.log")):
        if line.startswith("test ") and " ... " in line:
            test, res = line[5:].split(" ... ", 1)
            results[test.strip()] = res.strip()
    for test, res in sorted(results.items()):
        r.row(f"kernel test {test}", "PASS" if res == "ok" else "FAIL", "" if res == "ok" else res)
    if code != 0 or not results:
        r.row("kernel tests (tests/gpu.rs)", "FAIL", why(code, secs, r, name), secs)
    else:
        r.row("kernel tests (tests/gpu.rs)", "PASS", f"{len(results)} tests", secs)


def op_times(path):
    """[(name, count, forward ms, backward ms, rate)] from the `op\t...` lines of tests/gpu.rs `op_times`."""
    rows = []
    for line in open(path, errors="replace"):
        f = line.rstrip("\n").split("\t")
        if f[0] == "op" and len(f) == 6:
            rows.append((f[1], int(f[2]), float(f[3]), float(f[4]), f[5]))
    if not rows:
        raise ValueError(f"{path} holds no op times")
    return rows


def ops(r, limit):
    """Where a GPT-2 small step's GPU time goes, piece by piece (tests/gpu.rs `op_times`)."""
    name = "gpu-ops"
    cmd = [os.path.join(r.bin, "gpu-tests"), "--ignored", "--exact", "op_times", "--nocapture", "--test-threads=1"]
    code, secs = r.run(cmd, name, limit)
    try:
        rows = op_times(os.path.join(r.logs, f"{name}.log"))
    except (OSError, ValueError) as e:
        r.row("ops", "FAIL", f"{e}; " + why(code, secs, r, name), secs)
        return
    whole = [x for x in rows if x[0].startswith("whole model")]
    pieces = sorted((x for x in rows if x not in whole), key=lambda x: -x[1] * (x[2] + x[3]))
    total = sum(n * (f + b) for _, n, f, b, _ in pieces)
    detail = f"the pieces of a GPT-2 small step (batch 12 x 1024, bf16 matmuls) sum to {total:.1f} ms"
    if whole:
        detail += f"; the whole model's loss {whole[0][2]:.1f} ms and its backward {whole[0][3]:.1f} ms"
    r.row("ops", "INFO" if code == 0 else "FAIL", detail if code == 0 else why(code, secs, r, name), secs)
    for op, n, f, b, rate in pieces:
        r.row(f"ops: {op}", "INFO", f"{n} x (forward {f:.2f} ms, {rate}; backward {b:.2f} ms) = "
              f"{n * (f + b):.1f} ms, {n * (f + b) / max(total, 1e-9):.0%}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(r, log, name, steps, sets):
    cmd = [os.path.join(r.bin, "nanodist"), "train", os.path.join(r.bundle, "config", "quickstart-char.toml")]
    base = [f"train.n_steps={steps}", "train.lr_schedule.warmup_steps=2", "log.log_interval=5",
            f"log.eval_interval={steps}", "log.eval_steps=2", "log.ckpt_interval=0", f'log_dir="{log}"',
            f'log.run_name="{name}"', f'data_dir="{os.path.join(r.bundle, "data", "shakespeare_char")}"']
    for s in base + list(sets):
        cmd += ["--set", s]
    return cmd


def gpu_ranks(r, name, world, cmd, limit, codes_out=None):
    """`cmd` as `world` NCCL ranks on the one GPU; (ok, seconds, detail). `codes_out`, a list, gets each
    rank's exit code (None: stopped at the time limit)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(r.env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_HOSTID=f"nanodist-selftest-rank{rank}",
                   NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
        rank_cmd = cmd + ["--set", 'train.engine="nccl"'] if world > 1 else cmd
        procs.append(r.start(rank_cmd, f"{name}.rank{rank}", env))
    codes, secs = r.wait(procs, limit)
    if codes_out is not None:
        codes_out[:] = codes
    if all(c == 0 for c in codes):
        return True, secs, ""
    # The rank that failed, not one that was stopped because of it (None: killed, or still running).
    bad = next((i for i, c in enumerate(codes) if c not in (0, None)), None)
    if bad is None:
        bad = next(i for i, c in enumerate(codes) if c != 0)
    return False, secs, f"rank {bad}: " + why(codes[bad], secs, r, f"{name}.rank{bad}")


def nccl(r, limit):
    # The first run also JIT-compiles candle's PTX for this GPU (cached for the runs after it): half the time.
    shares = {1: 0.5, 2: 0.25}
    for world in sorted({1, 2, r.a.ranks}):
        log = os.path.join(r.work, "runs")
        # At world 1 the engine is named (more ranks get it from gpu_ranks).
        sets = ['train.device="cuda"'] + (['train.engine="nccl"'] if world == 1 else [])
        cmd = train_cmd(r, log, f"nccl-{world}", 4, sets)
        ok, secs, detail = gpu_ranks(r, f"nccl-{world}", world, cmd, min(limit * shares.get(world, 0.25), r.left()))
        r.row(f"nccl engine, {world} rank(s) on one GPU", "PASS" if ok else "FAIL", detail, secs)


def losses(path, after=0):
    rows = [json.loads(l) for l in open(path)]
    return {x["step"]: x["train_loss"] for x in rows if "train_loss" in x and x["step"] > after}


def worst_relative(a, b):
    if not a or a.keys() != b.keys():
        raise ValueError(f"logged steps differ: {sorted(a)} vs {sorted(b)}")
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def backends(r, limit):
    n, log = r.a.ranks, os.path.join(r.work, "runs")
    names = r.a.backends.split(",")
    end = time.monotonic() + limit
    for i, b in enumerate(names):
        # What the backends before left, shared evenly by the rest (CHOCO's 4 ranks are the slowest).
        each = min((end - time.monotonic()) / (len(names) - i), r.left())
        if each < 10:
            r.row(f"train {b}: GPU vs CPU loss", "SKIP", "out of time")
            continue
        sets = BACKENDS[b]
        t0 = time.monotonic()
        ok, secs, detail = gpu_ranks(r, f"gpu-{b}", n, train_cmd(r, log, f"gpu-{b}", r.a.steps,
                                                                sets + ['train.device="cuda"']), each * 0.7)
        if ok:
            cpu = train_cmd(r, log, f"cpu-{b}", r.a.steps, sets + ['train.device="cpu"']) + ["--workers", str(n)]
            code, s2 = r.run(cpu, f"cpu-{b}", max(5.0, each - (time.monotonic() - t0)))
            ok, detail = code == 0, "" if code == 0 else "CPU run " + why(code, s2, r, f"cpu-{b}")
        if ok:
            try:
                w = worst_relative(losses(f"{log}/gpu-{b}/metrics.jsonl"), losses(f"{log}/cpu-{b}/metrics.jsonl"))
                ok, detail = w < 0.02, f"max relative difference {w:.4f} over {r.a.steps} steps (bound 0.02)"
            except (OSError, ValueError) as e:
                ok, detail = False, str(e)
        r.row(f"train {b}: {n} GPU ranks vs {n} CPU workers", "PASS" if ok else "FAIL", detail,
              time.monotonic() - t0)


def checkpoints(r, limit):
    log = os.path.join(r.work, "ckpt")
    each = limit / 6
    for src in ("cuda", "cpu"):
        t0 = time.monotonic()
        cmd = train_cmd(r, log, f"ckpt-{src}", 10, [f'train.device="{src}"', "train.exit_interval=5"])
        code, secs = r.run(cmd, f"ckpt-{src}", each)
        found = sorted(glob.glob(f"{log}/ckpt-{src}/checkpoints/step_*"))
        if code != 0 or not found:
            r.row(f"checkpoint of a {src} run", "FAIL", why(code, secs, r, f"ckpt-{src}") if code != 0 else
                  "no checkpoint written", secs)
            continue
        for to in ("cuda", "cpu"):
            name = f"ckpt-{src}-on-{to}"
            cmd = train_cmd(r, log, name, 10, [f'train.device="{to}"', f'checkpoint="{found[-1]}"', "log.log_interval=1"])
            code, secs = r.run(cmd, name, each)
            if code != 0:
                r.row(f"resume a {src} checkpoint on {to}", "FAIL", why(code, secs, r, name), secs)
        other = "cpu" if src == "cuda" else "cuda"
        try:
            w = worst_relative(losses(f"{log}/ckpt-{src}-on-{other}/metrics.jsonl", 5),
                               losses(f"{log}/ckpt-{src}-on-{src}/metrics.jsonl", 5))
            r.row(f"checkpoint of a {src} run resumed on {other}", "PASS" if w < 1e-3 else "FAIL",
                  f"max relative difference {w:.2e} (bound 1e-3)", time.monotonic() - t0)
        except (OSError, ValueError) as e:
            r.row(f"checkpoint of a {src} run resumed on {other}", "FAIL", str(e), time.monotonic() - t0)


# ---------------------------------------------------------------------------------------------- speed


def gpt2_sets(r, log, batch, steps, warmup):
    c = GPT2
    return [f"model.vocab_size={c['vocab']}", f"train.context_length={c['context']}",
            f"train.local_batch_size={batch}", f"train.n_steps={steps}", "train.lr_schedule.warmup_steps=2",
            'train.device="cuda"', "train.amp=true", f"log.log_interval={warmup}", f"log.eval_interval={steps}",
            "log.eval_steps=1", "log.ckpt_interval=0", "log.eval_at_start=false", "log.wandb_log=false",
            f'log_dir="{log}"', 'log.run_name="bench"', f'data_dir="{os.path.join(r.bundle, "data", "shakespeare_char")}"']


def gpt2_cmd(r, sub, sets):
    cmd = [os.path.join(r.bin, "nanodist"), sub, os.path.join(r.bundle, "config", "gpt2-small.toml")]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def nanodist_speed(r, name, world, batch, extra, limit):
    """Tokens/s per rank (mean of the rows after the warm-up), or (None, why)."""
    a = r.a
    log = tempfile.mkdtemp(dir=r.work)
    sets = gpt2_sets(r, log, batch, a.speed_steps, a.speed_warmup) + [f"train.global_batch_size={batch * world}"]
    codes = []
    ok, secs, detail = gpu_ranks(r, name, world, gpt2_cmd(r, "train", sets + extra), limit, codes)
    # Ranks stopped at the time limit (none failed) still count: the rows they logged are timed steps; what
    # comes after them (the last evaluation, the final checkpoint of GPT-2 small's 1.5 GB) is not.
    stopped = not ok and all(c in (0, None) for c in codes)
    if not ok and not stopped:
        return None, detail
    try:
        rows = [json.loads(l) for l in open(os.path.join(log, "bench", "metrics.jsonl"))]
    except OSError:
        rows = []
    timed = [x["tokens_per_s"] for x in rows if x["step"] > a.speed_warmup and x.get("tokens_per_s")]
    if not timed:
        return None, detail or "no timed rows"
    last = max(x["step"] for x in rows)
    return statistics.mean(timed) / world, f"stopped at the time limit after step {last}" if stopped else ""


def torch_speed(r, batch, compile_, limit):
    cfg = dict(GPT2, batch=batch, steps=r.a.speed_steps, warmup=r.a.speed_warmup, compile=compile_, device="cuda",
               threads=4, activation="gelu", attention="sdpa",
               data=os.path.join(r.bundle, "data", "shakespeare_char", "train.bin"))
    name = f"torch-{'compiled' if compile_ else 'eager'}"
    script = os.path.join(r.bundle, "scripts", "nanogpt_step.py")
    code, secs = r.run([r.a.python, script, json.dumps(cfg)], name, limit)
    if code != 0:
        return None, why(code, secs, r, name)
    out = open(os.path.join(r.logs, f"{name}.log")).read().strip().splitlines()[-1]
    return json.loads(out)["tokens_per_s"], ""


def flops_per_token(r):
    code, _ = r.run(gpt2_cmd(r, "check", gpt2_sets(r, r.work, 1, 10, 5) + ['train.device="cpu"']), "flops", 60)
    for line in open(os.path.join(r.logs, "flops.log")):
        if line.startswith("FLOPs per token"):
            return float(line.split()[-1])
    raise Bad(f"`nanodist check` printed no FLOPs per token (exit {code}): {r.last_line('flops')}")


def speed(r, limit):
    a = r.a
    end = time.monotonic() + limit
    peak = next((p for k, p in BF16_PEAK.items() if k in (r.gpu or {}).get("name", "")), None)
    fpt = flops_per_token(r)
    head = f"GPT-2 small, batch {a.batch} x 1024, {a.speed_steps} steps ({a.speed_warmup} warm-up), " \
           f"{fpt / 1e9:.3f} GFLOP/token; dense bf16 peak " + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown")
    r.row("speed setup", "INFO", head)
    base = {}

    def show(label, tps, detail, key=None):
        if tps is None:
            r.row(label, "FAIL", detail)
            return
        note = f" ({detail})" if detail else ""
        if key:
            base[key] = tps
        mfu = f", MFU {tps * fpt / peak:.1%}" if peak else ""
        vs = f", {tps / base['torch']:.2f}x PyTorch SDPA bf16" if "torch" in base and key != "torch" else ""
        r.row(label, "INFO", f"{tps:,.0f} tokens/s{mfu}, {1000 * a.batch * 1024 / tps:.1f} ms/step{vs}{note}")

    left = lambda share: max(0.0, min(share, end - time.monotonic(), r.left()))  # noqa: E731
    show("speed: PyTorch nanoGPT, SDPA, bf16 autocast", *torch_speed(r, a.batch, False, left(limit * 0.2)), key="torch")
    show("speed: nanodist, 1 GPU, bf16 matmuls", *nanodist_speed(r, "speed-1", 1, a.batch, [], left(limit * 0.2)))
    world, batch = 2, max(1, a.batch // 4)
    steps = {}
    for b in SPEED_BACKENDS:
        if left(limit) < 20:
            r.row(f"speed: {b}", "SKIP", "out of time")
            continue
        tps, detail = nanodist_speed(r, f"speed-{b}", world, batch, BACKENDS[b], left(limit * 0.1))
        if tps is None:
            r.row(f"speed: {b}, {world} ranks on one GPU", "FAIL", detail)
            continue
        steps[b] = 1000 * batch * 1024 / tps
        rel = f", {steps[b] / steps['allreduce']:.2f}x all-reduce's" if "allreduce" in steps else ""
        note = f" ({detail})" if detail else ""
        r.row(f"speed: {b}, {world} ranks on one GPU (batch {batch} x 1024 each)", "INFO",
              f"{steps[b]:.1f} ms/step{rel}{note}")
    if left(limit) > 60:
        show("speed: PyTorch nanoGPT, SDPA, bf16, torch.compile", *torch_speed(r, a.batch, True, left(limit)))


# ---------------------------------------------------------------------------------------------- profile

# ncu's time units, in milliseconds.
UNIT_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3,
           "s": 1e3}


def kernel_times(path):
    """{kernel name: [milliseconds, launches]} from ncu's CSV (--csv --metrics gpu__time_duration.sum), whose
    log may hold other lines before the header."""
    import csv
    lines = open(path, errors="replace").read().splitlines()
    head = next((i for i, l in enumerate(lines) if '"Kernel Name"' in l and '"Metric Value"' in l), None)
    if head is None:
        raise ValueError(f"{path} holds no ncu CSV (no header with Kernel Name and Metric Value)")
    times = {}
    for row in csv.DictReader(lines[head:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNIT_MS.get(row.get("Metric Unit", "").strip())
        if unit is None:
            raise ValueError(f"unknown time unit {row.get('Metric Unit')!r} in {path}")
        name = row["Kernel Name"].split("(")[0].strip()
        t = times.setdefault(name, [0.0, 0])
        t[0] += float(row["Metric Value"].replace(",", "")) * unit
        t[1] += 1
    if not times:
        raise ValueError(f"{path}: ncu timed no kernel")
    return times


def ncu_path():
    found = [shutil.which("ncu")] + sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) + ["/usr/local/cuda/bin/ncu"]
    return next((p for p in found if p and os.path.exists(p)), None)


def profile(r, limit):
    """Where a GPT-2 small run spends the GPU's time: ncu's time of each of its first kernels (its start and
    first step), summed by kernel name, the largest first."""
    ncu = ncu_path()
    if not ncu:
        r.row("profile", "SKIP", "no ncu (Nsight Compute) on this machine")
        return
    log, out = tempfile.mkdtemp(dir=r.work), os.path.join(r.work, "ncu.csv")
    sets = gpt2_sets(r, log, r.a.profile_batch, 1, 1)
    cmd = [ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--launch-count",
           str(r.a.profile_kernels), "--csv", "--log-file", out] + gpt2_cmd(r, "train", sets)
    code, secs = r.run(cmd, "profile", limit)
    try:
        times = kernel_times(out)
    except (OSError, ValueError) as e:
        r.row("profile", "FAIL", f"{e}; " + why(code, secs, r, "profile"), secs)
        return
    total = sum(t for t, _ in times.values())
    launches = sum(n for _, n in times.values())
    r.row("profile", "INFO", f"GPT-2 small, batch {r.a.profile_batch} x 1024, bf16 matmuls: the run's first {launches} "
          f"kernels (its start and first step) take {total:.1f} ms on the GPU (ncu, gpu__time_duration)", secs)
    for name, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:r.a.profile_top]:
        r.row(f"profile: {name[:80]}", "INFO", f"{t:.2f} ms, {t / total:.1%}, {n} launches")


# ---------------------------------------------------------------------------------------------- driver

STEPS = [("probe", 20, None), ("libraries", 40, None), ("kernels", 90, kernels), ("ops", 60, ops), ("nccl", 80, nccl),
         ("backends", 200, backends), ("checkpoints", 50, checkpoints), ("speed", 240, speed),
         ("profile", 120, profile)]


def table(r):
    lines = [f"nanodist GPU self-test, bundle {r.manifest.get('commit', '?')} built {r.manifest.get('built', '?')} "
             f"({r.manifest.get('profile', 'release')} profile)",
             "", "| check | result | detail | s |", "|---|---|---|---|"]
    for x in r.rows:
        s = "" if x["seconds"] is None else f"{x['seconds']:.1f}"
        lines.append(f"| {x['check']} | {x['result']} | {x['detail'].replace('|', '/')} | {s} |")
    return "\n".join(lines) + "\n"


def finish(r):
    os.makedirs(r.out, exist_ok=True)
    text = table(r)
    print("\n" + text)
    open(os.path.join(r.out, "selftest.md"), "w").write(text)
    json.dump(dict(manifest=r.manifest, gpu=r.gpu, rows=r.rows), open(os.path.join(r.out, "selftest.json"), "w"),
              indent=1)
    with tarfile.open(os.path.join(r.out, "logs.tar.gz"), "w:gz") as t:
        t.add(r.logs, arcname="logs")
    shutil.rmtree(r.work, ignore_errors=True)
    print(f"table and logs in {r.out}")
    return 1 if any(x["result"] == "FAIL" for x in r.rows) else 0


def parse(argv):
    ap = argparse.ArgumentParser(description="nanodist's GPU self-test (see the file's docstring)")
    ap.add_argument("--bundle", default=HERE, help="the bundle folder (default: this file's)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "selftest-out")
    ap.add_argument("--ranks", type=int, default=4, help="NCCL ranks on the one GPU (default 4)")
    ap.add_argument("--steps", type=int, default=40, help="steps of the GPU-vs-CPU loss runs")
    ap.add_argument("--batch", type=int, default=12, help="GPT-2 small batch of the speed rows")
    ap.add_argument("--speed-steps", type=int, default=20)
    ap.add_argument("--speed-warmup", type=int, default=5)
    ap.add_argument("--profile-batch", type=int, default=4, help="GPT-2 small batch of the profile step")
    ap.add_argument("--profile-kernels", type=int, default=2500, help="kernels ncu times (from the first)")
    ap.add_argument("--profile-top", type=int, default=15, help="kernel names the table lists")
    ap.add_argument("--budget", type=float, default=560, help="seconds for the whole run (default 560)")
    ap.add_argument("--only", default="", help="comma-separated steps: " + ",".join(s for s, _, _ in STEPS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--python", default=shutil.which("python3") or sys.executable, help="Python with CUDA torch")
    ap.add_argument("--list", action="store_true", help="print the steps and their time bounds, then exit")
    ap.add_argument("--fake-gpu", default="", help='"NAME;CAPABILITY;DRIVER" instead of nvidia-smi')
    ap.add_argument("--lib-root", action="append", default=[], help="search libraries here only (repeatable)")
    a = ap.parse_args(argv)
    names = [s for s, _, _ in STEPS]
    only = [s for s in a.only.split(",") if s]
    bad = [s for s in only if s not in names] + [b for b in a.backends.split(",") if b not in BACKENDS]
    if bad:
        ap.error(f"unknown step or backend {bad}; steps: {', '.join(names)}; backends: {', '.join(BACKENDS)}")
    if a.ranks < 2 or a.speed_warmup >= a.speed_steps:
        ap.error("--ranks must be at least 2 and --speed-warmup below --speed-steps")
    a.only = only or names
    return a


def main(argv):
    a = parse(argv)
    if a.list:
        for s, bound, _ in STEPS:
            print(f"{s:<12} {bound:>4} s{'' if s in a.only else '  (not selected)'}")
        print(f"{'total':<12} {sum(b for _, b, _ in STEPS):>4} s bounds, run within --budget {a.budget:.0f} s")
        return 0
    r = Runner(a, a.out)
    r.bundle = os.path.abspath(a.bundle)
    try:
        r.manifest = json.load(open(os.path.join(r.bundle, "manifest.json")))
    except OSError as e:
        print(f"error: {r.bundle} is not a nanodist GPU bundle ({e}); build one with scripts/gpu-bundle.sh",
              file=sys.stderr)
        return 2
    r.env.setdefault("CUDA_CACHE_PATH", os.path.join(r.work, "cuda-cache"))  # one JIT cache for every run
    r.env.setdefault("CUDA_CACHE_MAXSIZE", str(4 << 30))
    try:
        unpack(r)
        probe(r)
        libraries(r)
        blocked = any(x["result"] == "FAIL" for x in r.rows)
        for name, bound, fn in STEPS[2:]:
            if name not in a.only:
                continue
            if blocked or r.a.fake_gpu:
                r.row(name, "SKIP", "the GPU or its libraries are missing" if blocked else "fake GPU")
                continue
            if r.left() < 10:
                r.row(name, "SKIP", f"out of time (--budget {a.budget:.0f} s)")
                continue
            try:
                fn(r, min(bound, r.left()))
            except (OSError, ValueError, KeyError) as e:
                r.row(name, "FAIL", f"{type(e).__name__}: {e}")
    except Bad as e:
        r.row("bundle", "FAIL", str(e))
        finish(r)
        return 2
    return finish(r)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
