#!/usr/bin/env python3
"""Benchmark: GPT-2 tokenization throughput of `nanodist prepare` vs Python tiktoken on the same text.

Runs both alternately, with 1 and 2 threads, several times, and prints the median MB/s of each and the
ratio. nanodist's number is the whole `prepare` (read, tokenize, split, write files); tiktoken's is
encode_ordinary_batch alone over the same documents, so the comparison favours tiktoken.

    python3 scripts/bench/prepare.py [CORPUS_DIR] [--runs N]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    argv = sys.argv[1:]
    runs = 5
    if "--runs" in argv:
        i = argv.index("--runs")
        runs = int(argv[i + 1])
        del argv[i:i + 2]
    args = argv
    corpus = args[0] if args else os.path.join(ROOT, "data/corpus/shakespeare")
    if not os.path.isdir(corpus):
        subprocess.run([os.path.join(ROOT, "scripts/fetch_corpus.sh")], check=True)
    files = sorted(os.path.join(corpus, f) for f in os.listdir(corpus) if f.endswith(".txt"))
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    exe = os.path.join(ROOT, "target/release/nanodist")
    results = {}
    for _ in range(runs):
        for threads in (1, 2):
            with tempfile.TemporaryDirectory() as out:
                p = subprocess.run(
                    [exe, "prepare", "--input", corpus, "--output", out, "--threads", str(threads)],
                    check=True, capture_output=True, text=True)
                mbs = float(p.stdout.split(" MB/s")[0].rsplit(": ", 1)[1])
                results.setdefault(("nanodist", threads), []).append(mbs)
            p = subprocess.run(
                [sys.executable, os.path.join(ROOT, "scripts/gpt2_ids.py"), "--bench", *files],
                check=True, capture_output=True, text=True, env={**os.environ, "THREADS": str(threads)})
            results.setdefault(("tiktoken", threads), []).append(json.loads(p.stdout)["mb_per_s"])
    size = sum(os.path.getsize(f) for f in files) / 1e6
    print(f"corpus: {corpus} ({len(files)} files, {size:.1f} MB), median of {runs} runs")
    print(f"{'threads':>7} {'nanodist MB/s':>14} {'tiktoken MB/s':>14} {'ratio':>6}")
    for threads in (1, 2):
        n = statistics.median(results[("nanodist", threads)])
        t = statistics.median(results[("tiktoken", threads)])
        print(f"{threads:>7} {n:>14.2f} {t:>14.2f} {n / t:>6.2f}")


if __name__ == "__main__":
    main()
