#!/usr/bin/env bash
# Builds the GPU self-test bundle on a machine without a GPU or CUDA toolkit (the CPU build machine, CI), then
# checks it (scripts/gpu/check-bundle.py). The bundle holds everything the self-test needs on a GPU machine
# that has a CUDA 13 driver, CUDA/cuBLAS/NCCL libraries (a toolkit or PyTorch's wheels) and Python, and no
# Rust, network or mpirun:
#   bin/nanodist.xz, bin/gpu-tests.xz   the release binary and tests/gpu.rs, --features cuda, stripped and
#                                 compressed (candle's kernels make them 100 MB; the self-test unpacks them)
#   kernels/*.fatbin              nanodist's kernels as embedded in the binaries: SASS sm_80 + sm_90, PTX
#   data/shakespeare_char         the quick-start data, prepared by bin/nanodist
#   config/                       quickstart-char.toml, gpt2-small.toml
#   scripts/                      PyTorch nanoGPT's step (the speed baseline) and its model
#   selftest.py                   the self-test (scripts/gpu/selftest.py)
#   manifest.json                 commit, toolkit, libraries the binaries need, sizes
# Everything CUDA is compiled by the CUDA 13.0 toolkit from PyPI (scripts/cuda/env.sh), so candle's PTX is
# ISA 9.0 and loads on any CUDA 13 driver.
#
#   scripts/gpu-bundle.sh [DIR]      # default .gpu-bundle; then, on the GPU machine: python3 DIR/selftest.py
#
# The binaries are built in the release profile, in $NANODIST_CUDA_TARGET_DIR (default outside the clone, kept
# between builds). NANODIST_BUNDLE_PROFILE=dev builds them in the test build's profile instead (optimized, with
# nanodist's debug assertions): CI does so in the test build's target directory, where every dependency that
# the CUDA path does not change is already compiled. The manifest records the profile; a bundle for a GPU run
# is a release one.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu-bundle}
root=$PWD
profile=${NANODIST_BUNDLE_PROFILE:-release}
case "$profile" in
    release | dev) ;;
    *) echo "error: NANODIST_BUNDLE_PROFILE=$profile: allowed are release (the default) and dev" >&2; exit 2 ;;
esac
source scripts/cuda/env.sh
export CARGO_TARGET_DIR="${NANODIST_CUDA_TARGET_DIR:-$HOME/.cache/nanodist/cuda-target}"
stubs="$CARGO_TARGET_DIR/cuda-stubs"
python3 scripts/cuda/stubs.py "$stubs" --cudart "$CUDA_HOME/lib/libcudart.so.13"
export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"

# The binary and the GPU test binary; cargo's JSON messages name the test executable.
cargo build --locked --profile "$profile" --features cuda --bin nanodist --test gpu --message-format=json-render-diagnostics \
    >"$CARGO_TARGET_DIR/bundle-build.json"
artifact() { # what: the executable of target `bin` or `test`, or the out_dir of nanodist's build script
    python3 - "$CARGO_TARGET_DIR/bundle-build.json" "$1" "$root" <<'PY'
import json, sys
path, what, root = sys.argv[1:]
for line in open(path):
    m = json.loads(line)
    ours = m.get("package_id", "").split("#")[0] == "path+file://" + root
    if what == "out_dir" and m.get("reason") == "build-script-executed" and ours:
        print(m["out_dir"])
        break
    if m.get("reason") == "compiler-artifact" and ours and what in m["target"]["kind"] and m.get("executable"):
        print(m["executable"])
        break
else:
    sys.exit(f"cargo's messages name no {what} of nanodist")
PY
}
exe=$(artifact bin)
tests=$(artifact test)
fatbins=$(artifact out_dir)

rm -rf "$out"
mkdir -p "$out"/{bin,kernels,config,data,scripts}
unpacked="$CARGO_TARGET_DIR/bundle-bin"
mkdir -p "$unpacked"
strip -o "$unpacked/nanodist" "$exe"
strip -o "$unpacked/gpu-tests" "$tests"
for b in nanodist gpu-tests; do xz -T0 -6 -c "$unpacked/$b" >"$out/bin/$b.xz"; done
cp "$fatbins"/*.fatbin "$out/kernels/"
cp config/quickstart-char.toml config/gpt2-small.toml "$out/config/"
cp scripts/torch_parity.py scripts/nanogpt_step.py "$out/scripts/"
cp scripts/gpu/selftest.py "$out/selftest.py"

# The quick-start data, prepared by the bundle's own binary on the CPU (the link-time stand-ins answer "no
# GPU" to every CUDA call).
[ -d data/corpus/shakespeare ] || ./scripts/fetch_corpus.sh
LD_LIBRARY_PATH="$stubs" "$unpacked/nanodist" prepare --input data/corpus/shakespeare \
    --output "$out/data/shakespeare_char" --tokenizer char --val-fraction 0.1 >/dev/null

python3 - "$out" "$root" "$unpacked" "$profile" <<'PY'
import json, os, subprocess, sys, time
out, root, unpacked, profile = sys.argv[1:]
def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=root).stdout.strip()
needed = set()
for b in ("nanodist", "gpu-tests"):
    for line in sh("readelf", "-d", os.path.join(unpacked, b)).splitlines():
        if "(NEEDED)" in line:
            needed.add(line.split("[")[1].rstrip("]"))
dirty = "-dirty" if sh("git", "status", "--porcelain", "--untracked-files=no") else ""
files = {os.path.relpath(os.path.join(d, f), out): os.path.getsize(os.path.join(d, f))
         for d, _, fs in os.walk(out) for f in fs}
manifest = dict(commit=sh("git", "rev-parse", "--short", "HEAD") + dirty, profile=profile,
                built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                nvcc=sh("nvcc", "--version").splitlines()[-2], needed=sorted(needed), files=files)
json.dump(manifest, open(os.path.join(out, "manifest.json"), "w"), indent=1)
PY
echo "bundle in $out: $(du -sh "$out" | cut -f1)"
python3 scripts/gpu/check-bundle.py "$out" --stubs "$stubs"
