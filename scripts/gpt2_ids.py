#!/usr/bin/env python3
"""GPT-2 token ids from Python tiktoken, offline.

tiktoken downloads r50k_base on first use; that host is unreachable here, so this script points
TIKTOKEN_CACHE_DIR at a cache holding the ranks file that the tiktoken-rs crate embeds (found in the cargo
registry), stored under the sha1 of the URL tiktoken would fetch.

    python3 scripts/gpt2_ids.py FILE...        -> one JSON array of ids per file, one per line
    python3 scripts/gpt2_ids.py --bench FILE   -> MB/s of encode_ordinary_batch over the file's documents
"""
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"


def offline_cache():
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "nanodist-tiktoken")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, hashlib.sha1(URL.encode()).hexdigest())
    if not os.path.exists(target):
        home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
        found = sorted(glob.glob(os.path.join(home, "registry/src/*/tiktoken-rs-*/assets/r50k_base.tiktoken")))
        if not found:
            sys.exit("r50k_base.tiktoken not found in the cargo registry: build nanodist first")
        shutil.copy(found[-1], target)
    os.environ["TIKTOKEN_CACHE_DIR"] = cache


def main():
    offline_cache()
    import tiktoken

    # "gpt2" would fetch the data-gym vocab files; r50k_base is the same ranks and pattern in one file.
    enc = tiktoken.get_encoding("r50k_base")
    args = sys.argv[1:]
    if args and args[0] == "--bench":
        paths = args[1:]
        docs = [open(p, encoding="utf-8", newline="").read() for p in paths]
        size = sum(len(d.encode()) for d in docs)
        threads = int(os.environ.get("THREADS", "1"))
        start = time.perf_counter()
        enc.encode_ordinary_batch(docs, num_threads=threads)
        secs = time.perf_counter() - start
        print(json.dumps({"mb": size / 1e6, "seconds": secs, "mb_per_s": size / 1e6 / secs, "threads": threads}))
        return
    for p in args:
        with open(p, encoding="utf-8", newline="") as f:
            print(json.dumps(enc.encode_ordinary(f.read())))


if __name__ == "__main__":
    main()
