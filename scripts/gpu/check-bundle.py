#!/usr/bin/env python3
"""Checks a GPU self-test bundle (scripts/gpu-bundle.sh builds and checks one; CI runs both) on a machine
without a GPU:

1. its size: at most 48 MiB, so that a working tree fits beside it in one device call (64 MiB);
2. every PTX it ships is of ISA 9.0 or older (a CUDA 13.0 driver compiles no newer PTX): candle's kernels
   (PTX text in the binaries), nanodist's kernels (kernels/*.fatbin) and any fatbin section of the binaries
   (cuobjdump --dump-ptx);
3. nanodist's fatbins hold SASS for sm_80 and sm_90 (cuobjdump --list-elf) and are the bytes the binary
   embeds;
4. the binaries need no library that the lent GPU image lacks (readelf's NEEDED entries: the C and C++
   runtimes, and the CUDA libraries that the self-test finds at run time) and no glibc newer than 2.35;
5. the binary runs its CPU paths with the link-time stand-ins as its CUDA libraries (`--stubs`): it trains
   the bundle's data on the CPU, and `train.device = "cuda"` is refused with exit 2 (no GPU);
6. the self-test's own parts that need no GPU: its arguments, its step list and budget, library discovery and
   the table, with a fake GPU probe and a fake library tree, one library missing or none; the profile step's
   reading of ncu's CSV and the ops step's reading of tests/gpu.rs `op_times`.

    python3 scripts/gpu/check-bundle.py .gpu-bundle --stubs DIR
"""
import argparse
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile

LIMIT = 48 << 20
MAX_PTX = (9, 0)
SASS = ("sm_80", "sm_90")
RUNTIMES = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libstdc++.so.6", "libdl.so.2", "libpthread.so.0",
            "librt.so.1", "ld-linux-x86-64.so.2"}
# Found on the lent image by the self-test: the driver's libcuda, the CUDA 13 wheels' (or toolkit's) others.
CUDA = {"libcuda.so.1", "libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10",
        "libnvrtc.so.13", "libnccl.so.2"}
MAX_GLIBC = (2, 35)

failures = []


def check(ok, what):
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


def run(*cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def size(b):
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(b) for f in fs)
    check(total <= LIMIT, f"size {total / 2**20:.1f} MiB <= {LIMIT >> 20} MiB")


def ptx_versions(b, bins, fatbins):
    found = []
    for path in bins:  # PTX kept as text (candle's kernels): ".version X.Y" then ".target sm_NN"
        data = open(path, "rb").read()
        found += [(path, int(x), int(y)) for x, y in re.findall(rb"\.version (\d+)\.(\d+)\s+\.target sm_", data)]
    for path in bins + fatbins:  # PTX inside fatbins (cuobjdump unpacks them)
        out = run("cuobjdump", "--dump-ptx", path).stdout
        found += [(path, int(x), int(y)) for x, y in re.findall(r"^\.version (\d+)\.(\d+)", out, re.M)]
    newest = max(((x, y) for _, x, y in found), default=None)
    check(bool(found), f"{len(found)} PTX modules found in the bundle")
    bad = sorted({f"{os.path.relpath(p, b)}: {x}.{y}" for p, x, y in found if (x, y) > MAX_PTX})
    check(not bad, f"every PTX is ISA <= {MAX_PTX[0]}.{MAX_PTX[1]} (newest {newest}){'; newer: ' + ', '.join(bad) if bad else ''}")


def sass(b, fatbins, exe):
    data = open(exe, "rb").read()
    check(len(fatbins) >= 2, f"{len(fatbins)} kernel fatbins: {', '.join(map(os.path.basename, fatbins))}")
    for f in fatbins:
        elves = run("cuobjdump", "--list-elf", f).stdout
        have = [a for a in SASS if f".{a}.cubin" in elves]
        check(have == list(SASS), f"{os.path.basename(f)}: SASS for {', '.join(have) or 'nothing'} (want {', '.join(SASS)})")
        check(open(f, "rb").read() in data, f"{os.path.basename(f)} is what nanodist embeds")


def needed(bins):
    for path in bins:
        dyn = run("readelf", "-d", "-W", path).stdout
        libs = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn))
        extra = sorted(libs - RUNTIMES - CUDA)
        check(not extra, f"{os.path.basename(path)} needs {', '.join(sorted(libs))}"
              + (f"; not on the GPU image: {', '.join(extra)}" if extra else ""))
        syms = run("readelf", "-V", "-W", path).stdout
        glibc = max((tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+(?:\.\d+)?)", syms)),
                    default=(0, 0))
        check(glibc <= MAX_GLIBC, f"{os.path.basename(path)} needs glibc {'.'.join(map(str, glibc))} "
              f"(<= {'.'.join(map(str, MAX_GLIBC))})")


def cpu_paths(b, exe, stubs):
    env = dict(os.environ, LD_LIBRARY_PATH=stubs)
    with tempfile.TemporaryDirectory() as log:
        sets = ["train.n_steps=6", "train.lr_schedule.warmup_steps=2", "log.log_interval=3", "log.eval_interval=6", "log.eval_steps=1",
                "log.ckpt_interval=0", f'log_dir="{log}"', 'log.run_name="cpu"',
                f'data_dir="{os.path.join(b, "data", "shakespeare_char")}"']
        cmd = [exe, "train", os.path.join(b, "config", "quickstart-char.toml")]
        for s in sets:
            cmd += ["--set", s]
        p = run(*cmd, "--set", 'train.device="cpu"', env=env)
        rows = os.path.join(log, "cpu", "metrics.jsonl")
        ok = p.returncode == 0 and os.path.exists(rows)
        check(ok, f"nanodist trains the bundle's data on the CPU (exit {p.returncode})"
              + ("" if ok else f": {p.stderr.strip()[-300:]}"))
        p = run(*cmd, "--set", 'train.device="cuda"', env=env)
        err = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        check(p.returncode == 2 and "finds no GPU" in err, f"train.device = \"cuda\" without a GPU: exit "
              f"{p.returncode} (want 2): {err}")


def selftest(b):
    st = [sys.executable, os.path.join(b, "selftest.py")]
    p = run(*st, "--list")
    bounds = [int(m) for m in re.findall(r"^\w+\s+(\d+) s", p.stdout, re.M)]
    check(p.returncode == 0 and len(bounds) >= 5, f"selftest.py --list: {len(bounds)} steps")
    p = run(*st, "--only", "nonsense")
    check(p.returncode == 2 and "unknown step" in p.stderr, f"selftest.py --only nonsense: exit {p.returncode}")
    needs = [n for n in json.load(open(os.path.join(b, "manifest.json")))["needed"] if n not in RUNTIMES]
    with tempfile.TemporaryDirectory() as tmp:
        for missing in (None, needs[0]):
            root = os.path.join(tmp, f"libs-{missing}")
            for i, n in enumerate(needs):  # two folders, as the wheels have
                if n != missing:
                    d = os.path.join(root, f"pkg{i % 2}", "lib")
                    os.makedirs(d, exist_ok=True)
                    open(os.path.join(d, n), "w").close()
            out = os.path.join(tmp, f"out-{missing}")
            p = run(*st, "--fake-gpu", "NVIDIA H100 80GB HBM3;9.0;580.159.04", "--lib-root", root, "--out", out)
            table = open(os.path.join(out, "selftest.md")).read() if os.path.exists(os.path.join(out, "selftest.md")) else ""
            rows = json.load(open(os.path.join(out, "selftest.json")))["rows"] if table else []
            found = {r["check"][8:] for r in rows if r["check"].startswith("library ") and r["result"] == "PASS"}
            ld = next((r["detail"] for r in rows if r["check"] == "LD_LIBRARY_PATH"), "")
            if missing is None:
                check(p.returncode == 0 and found == set(needs) and ld.count(root) == min(2, len(needs))
                      and "| probe | PASS |" in table and os.path.exists(os.path.join(out, "logs.tar.gz")),
                      f"fake GPU, every library present: exit {p.returncode}, {len(found)}/{len(needs)} found, "
                      f"LD_LIBRARY_PATH={ld}")
            else:
                check(p.returncode == 1 and f"| library {missing} | FAIL |" in table and found == set(needs) - {missing},
                      f"fake GPU, {missing} missing: exit {p.returncode}, named in the table")


def selftest_module(b):
    """The bundle's selftest.py as a module, for its parts that need no GPU."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("selftest", os.path.join(b, "selftest.py"))
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)
    return st


def read_both(parse, lines, other):
    """`parse` of a file of `lines`, and what it says of a file of `other` lines: "read" or its error."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "log")
        open(path, "w").write("\n".join(lines) + "\n")
        got = parse(path)
        open(path, "w").write("\n".join(other) + "\n")
        try:
            parse(path)
            empty = "read"
        except ValueError as e:
            empty = str(e)
    return got, empty


def profile_parser(b):
    """The profile step's reading of ncu's CSV: ncu's own lines before the header, times in mixed units,
    template arguments kept and parameters dropped from the names, other metrics ignored."""
    st = selftest_module(b)
    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",' \
           '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
    def row(i, name, metric, unit, value):
        return f'"{i}","7","nanodist","127.0.0.1","{name}","1","13","(256, 1, 1)","(4, 1, 1)","0","9.0",' \
               f'"Command line profiler metrics","{metric}","{unit}","{value}"'
    lines = ["==PROF== Connected to process 7", "==PROF== Profiling \"ucopy_f32\" - 0: 0%....100% - 1 pass", head,
             row(0, "ucopy_f32", "gpu__time_duration.sum", "usecond", "1,500.00"),
             row(1, "void gemm<bf16, 128>(const T *, int)", "gpu__time_duration.sum", "msecond", "2.25"),
             row(2, "ucopy_f32", "gpu__time_duration.sum", "nsecond", "500"),
             row(3, "ucopy_f32", "sm__throughput.avg.pct_of_peak_sustained_elapsed", "%", "80")]
    got, empty = read_both(st.kernel_times, lines, ["==PROF== Disconnected"])
    want = {"ucopy_f32": [1.5005, 2], "void gemm<bf16, 128>": [2.25, 1]}
    same = got.keys() == want.keys() and all(abs(got[k][0] - want[k][0]) < 1e-9 and got[k][1] == want[k][1]
                                             for k in want)
    check(same and "no ncu CSV" in empty, f"profile: ncu's CSV read as {got}; a log without one: {empty}")


def ops_parser(b):
    """The ops step's reading of tests/gpu.rs `op_times`: its op lines among the test harness's own, the rate
    column empty for the whole model; a log without op lines is refused."""
    st = selftest_module(b)
    lines = ["running 1 test", "op\tmatmul bf16: mlp up\t12\t0.250\t0.500\t512 TFLOP/s",
             "op\twhole model: loss and its backward\t1\t30.000\t60.000\t", "test op_times ... ok"]
    got, empty = read_both(st.op_times, lines, ["running 1 test"])
    want = [("matmul bf16: mlp up", 12, 0.25, 0.5, "512 TFLOP/s"), ("whole model: loss and its backward", 1, 30.0, 60.0, "")]
    check(got == want and "no op times" in empty, f"ops: op_times read as {got}; a log without them: {empty}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--stubs", required=True, help="the link-time stand-ins (scripts/cuda/stubs.py)")
    a = ap.parse_args()
    b = os.path.abspath(a.bundle)
    if not shutil.which("cuobjdump"):
        sys.exit("cuobjdump is not on PATH: source scripts/cuda/env.sh")
    fatbins = sorted(os.path.join(b, "kernels", f) for f in os.listdir(os.path.join(b, "kernels")))
    size(b)
    with tempfile.TemporaryDirectory() as tmp:
        bins = []
        for n in ("nanodist", "gpu-tests"):
            bins.append(os.path.join(tmp, n))
            with lzma.open(os.path.join(b, "bin", f"{n}.xz")) as f, open(bins[-1], "wb") as g:
                shutil.copyfileobj(f, g, 1 << 20)
            os.chmod(bins[-1], 0o755)
        ptx_versions(tmp, bins, fatbins)
        sass(b, fatbins, bins[0])
        needed(bins)
        cpu_paths(b, bins[0], os.path.abspath(a.stubs))
    selftest(b)
    profile_parser(b)
    ops_parser(b)
    if failures:
        print(f"\n{len(failures)} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("\nthe bundle passes every check")


if __name__ == "__main__":
    main()
