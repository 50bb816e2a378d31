# Source me: the CUDA 13.0 compiler from PyPI (pinned, one version for every part) for `--features cuda`
# builds on machines without a CUDA toolkit. Installs into .venv/cuda13.0 on first use. 13.0 because a
# driver JIT-compiles only PTX of an ISA no newer than its own: PTX from 13.0 (ISA 9.0) loads on every CUDA 13
# driver (R580 and newer), PTX from 13.4 (ISA 9.4) does not load on a 13.0 driver. nvcc, its runtime, NVVM
# and crt must be one release (mixed releases emit PTX that ptxas rejects); the CCCL headers (nv/target,
# needed by cuda_fp16.h) and the runtime library are versioned on their own: those of the 13.0 release.
# cuobjdump (for the bundle's checks) is a standalone reader: the oldest on PyPI.
_nd_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
_nd_venv="$_nd_root/.venv/cuda13.0"
_nd_ver=13.0.88
if [ ! -x "$_nd_venv/bin/python" ]; then python3 -m venv "$_nd_venv"; fi
if ! "$_nd_venv/bin/python" -c "import importlib.metadata as m; assert m.version('nvidia-cuda-nvcc') == '$_nd_ver'; m.version('nvidia-cuda-cuobjdump')" 2>/dev/null; then
    "$_nd_venv/bin/pip" install --quiet --disable-pip-version-check \
        nvidia-cuda-nvcc==$_nd_ver nvidia-nvvm==$_nd_ver nvidia-cuda-crt==$_nd_ver nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-cccl==13.0.85 nvidia-cuda-cuobjdump==13.2.51
fi
CUDA_HOME="$(echo "$_nd_venv"/lib/python3*/site-packages/nvidia/cu13)"
export CUDA_HOME
export PATH="$CUDA_HOME/bin:$PATH"
# candle-kernels compiles its PTX for this compute capability (A100 = 80; the driver compiles PTX of 8.0
# for H100 = 90 too).
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
# candle-kernels compiles its 27 kernel files on half the cores by default (cudaforge), one at a time on
# a 2-core machine, while the rest of the build waits for them: on every core.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
unset _nd_root _nd_venv _nd_ver
