#!/usr/bin/env bash
# Every GPU check in one run, for the day a GPU machine is available (CUDA toolkit or this repo's PyPI
# nvcc, NCCL, driver R580+ for CUDA 13 PTX; Open MPI for multi-GPU runs). Prints a pass/fail table.
#   1. build with --features cuda,mpi (CUDA_COMPUTE_CAP from the first GPU)
#   2. each reducer and optimizer kernel against its CPU twin, bit for bit, and NCCL at world size 1
#      (tests/gpu.rs)
#   3. the NCCL engine at every GPU count present (mpirun -np G): a 2-step training run
#   4. per backend, 40 steps on the GPUs (nccl engine, G ranks) against the CPU run of the same seed
#      (local engine, G workers): train loss within 2% at every logged step
#   5. checkpoints across devices: a GPU run's checkpoint resumed on the CPU and a CPU run's on the GPU,
#      against the same checkpoint resumed on its own device (train loss within 1e-3 at every logged step:
#      the state is restored exactly; the devices' f32 arithmetic differs in order from there on)
#   6. speed (scripts/bench/gpu.py): GPT-2 small tokens/s and MFU, nanodist vs PyTorch nanoGPT (SDPA, bf16
#      autocast) on one GPU, and ms/step per sync backend at world size = GPU count
# Usage: scripts/gpu-selftest.sh [steps]
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-40}
results=()
record() { results+=("$(printf '%-58s %s' "$1" "$2")"); }

command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script needs a GPU machine" >&2; exit 2; }
gpus=$(nvidia-smi -L | grep -c '^GPU')
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-$cap}
command -v nvcc >/dev/null || source scripts/cuda/env.sh
echo "GPUs: $gpus, compute capability $CUDA_COMPUTE_CAP, driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"

if cargo build --release --features cuda,mpi; then record "build --features cuda,mpi" PASS; else
    record "build --features cuda,mpi" FAIL; printf '%s\n' "${results[@]}"; exit 1; fi
bin=./target/release/nanodist

out=$(cargo test --release --features cuda,mpi --test gpu -- --test-threads=1 2>&1)
echo "$out" | tail -20
for t in top_k_kernel_equals_its_twin gather_scatter_and_error_feedback_kernels_equal_their_twins \
         gram_schmidt_kernel_equals_its_twin optimizer_kernels_equal_their_twins_over_several_steps \
         sum_squares_kernel_equals_its_twin gossip_kernels_equal_their_twins nccl_engine_at_world_size_one \
         top_k_reducer_on_the_gpu_equals_its_host_path radius_reducer_on_the_gpu_equals_its_host_path \
         powersgd_reducer_on_the_gpu_follows_its_host_path diloco_on_the_gpu_equals_its_host_path \
         demo_on_the_gpu_equals_its_host_path choco_on_the_gpu_equals_its_host_path \
         quantized_all_reduce_on_the_gpu_equals_its_host_path; do
    if echo "$out" | grep -q "test $t ... ok"; then record "$t" PASS; else record "$t" FAIL; fi
done

[ -d data/shakespeare_char ] || { ./scripts/fetch_corpus.sh && $bin prepare --input data/corpus/shakespeare \
    --output data/shakespeare_char --tokenizer char --val-fraction 0.1; }
logs=$(mktemp -d)
common=(--set train.n_steps=$steps --set train.lr_schedule.warmup_steps=2 --set log.log_interval=5 --set log.eval_interval=$steps --set log.eval_steps=2
        --set log.ckpt_interval=0 --set "log_dir=\"$logs\"")
gpu_run() { # name gpus args...
    local name=$1 g=$2; shift 2
    mpirun --oversubscribe -np "$g" $bin train config/quickstart-char.toml "${common[@]}" \
        --set train.engine=nccl --set train.device=cuda --set "log.run_name=\"$name\"" "$@" >"$logs/$name.out" 2>&1
}
cpu_run() {
    local name=$1 g=$2; shift 2
    $bin train config/quickstart-char.toml "${common[@]}" --workers "$g" --set "log.run_name=\"$name\"" "$@" \
        >"$logs/$name.out" 2>&1
}
for g in $(seq 1 "$gpus"); do
    if gpu_run "nccl-$g" "$g" --set train.n_steps=2; then record "nccl engine, $g GPU(s)" PASS
    else record "nccl engine, $g GPU(s) (see $logs/nccl-$g.out)" FAIL; fi
done

compare() { # name: train loss of gpu-<name> within 2% of cpu-<name> at every logged step
    python3 - "$logs/gpu-$1/metrics.jsonl" "$logs/cpu-$1/metrics.jsonl" <<'PY'
import json, sys
def rows(p):
    return {r["step"]: r["train_loss"] for r in map(json.loads, open(p)) if "train_loss" in r}
g, c = rows(sys.argv[1]), rows(sys.argv[2])
assert g and g.keys() == c.keys(), (sorted(g), sorted(c))
worst = max(abs(g[s] - c[s]) / abs(c[s]) for s in c)
print(f"max relative difference {worst:.4f}")
sys.exit(0 if worst < 0.02 else 1)
PY
}
backends=(
    "allreduce|"
    "gossip-ring|--set train.backend=decentdp --set train.topology=ring"
    "topk|--set train.compression={name=\"topk\",density=0.1}"
    "radius|--set train.compression={name=\"radius\",density=0.1,interval=10,threshold=10}"
    "powersgd|--set train.compression={name=\"powersgd\",rank=4,start_iter=10}"
    "sparta|--set train.backend=\"sparta\" --set train.sparta.p=0.05"
    "amp-bf16|--set train.amp=true"
)
for b in "${backends[@]}"; do
    name=${b%%|*}; read -r -a args <<<"${b#*|}"
    if gpu_run "gpu-$name" "$gpus" "${args[@]}" && cpu_run "cpu-$name" "$gpus" "${args[@]}" \
        && diff=$(compare "$name"); then record "train $name: GPU vs CPU loss ($diff)" PASS
    else record "train $name: GPU vs CPU loss ${diff:-} (logs in $logs)" FAIL; fi
done

compare_at() { # tolerance a b: train loss of run dirs a and b at every logged step after the resume
    python3 - "$@" <<'PY'
import json, sys
tol, a, b = float(sys.argv[1]), sys.argv[2], sys.argv[3]
def rows(p):
    return {r["step"]: r["train_loss"] for r in map(json.loads, open(p + "/metrics.jsonl")) if r["step"] > 5}
x, y = rows(a), rows(b)
assert x and x.keys() == y.keys(), (sorted(x), sorted(y))
worst = max(abs(x[s] - y[s]) / abs(y[s]) for s in y)
print(f"max relative difference {worst:.2e}")
sys.exit(0 if worst < tol else 1)
PY
}
# The checkpoint a run on each device saves when it stops at step 5, resumed to step 10 on both devices.
for from in cuda cpu; do
    src="ckpt-$from"
    $bin train config/quickstart-char.toml "${common[@]}" --set train.n_steps=10 --set train.exit_interval=5 \
        --set "train.device=\"$from\"" --set "log.run_name=\"$src\"" >"$logs/$src.out" 2>&1
    ck=$(ls -d "$logs/$src/checkpoints/"step_* 2>/dev/null | tail -1)
    for to in cuda cpu; do
        $bin train config/quickstart-char.toml "${common[@]}" --set train.n_steps=10 --set log.log_interval=1 \
            --set "checkpoint=\"$ck\"" --set "train.device=\"$to\"" --set "log.run_name=\"$src-on-$to\"" \
            >"$logs/$src-on-$to.out" 2>&1
    done
    other=$([ "$from" = cuda ] && echo cpu || echo cuda)
    if [ -n "$ck" ] && diff=$(compare_at 1e-3 "$logs/$src-on-$other" "$logs/$src-on-$from"); then
        record "checkpoint of a $from run resumed on $other ($diff)" PASS
    else record "checkpoint of a $from run resumed on $other ${diff:-} (logs in $logs)" FAIL; fi
done

echo
echo "speed (scripts/bench/gpu.py):"
python3 scripts/bench/gpu.py --exe "$bin" || record "speed section (scripts/bench/gpu.py)" FAIL

echo
printf '%-58s %s\n' "check" "result"
printf '%s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q FAIL
