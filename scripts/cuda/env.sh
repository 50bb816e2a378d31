# Source me: the CUDA 13 compiler from PyPI (pinned, one version for every part) for `--features cuda`
# builds on machines without a CUDA toolkit. Installs into .venv/cuda13 on first use. nvcc, its runtime
# headers, NVVM and crt must be one version (mixed versions emit PTX that ptxas rejects); the CCCL headers
# (nv/target, needed by cuda_fp16.h) are versioned on their own: the newest release at the time of writing.
_nd_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
_nd_venv="$_nd_root/.venv/cuda13"
_nd_ver=13.4.92
if [ ! -x "$_nd_venv/bin/python" ]; then python3 -m venv "$_nd_venv"; fi
if ! "$_nd_venv/bin/python" -c "import importlib.metadata as m; assert m.version('nvidia-cuda-nvcc') == '$_nd_ver'" 2>/dev/null; then
    "$_nd_venv/bin/pip" install --quiet --disable-pip-version-check \
        nvidia-cuda-nvcc==$_nd_ver nvidia-cuda-runtime==$_nd_ver nvidia-nvvm==$_nd_ver nvidia-cuda-crt==$_nd_ver nvidia-cuda-cccl==13.3.5.0.6
fi
CUDA_HOME="$(echo "$_nd_venv"/lib/python3*/site-packages/nvidia/cu13)"
export CUDA_HOME
export PATH="$CUDA_HOME/bin:$PATH"
# candle-kernels compiles its PTX for this compute capability (A100 = 80, H100 = 90).
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
unset _nd_root _nd_venv _nd_ver
