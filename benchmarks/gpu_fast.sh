#!/usr/bin/env bash
# Build the fast transport's extension, smoke-test NVSHMEM, run the transfer benchmark and the GPU tests.
# Usage (repo root, on the GPU machine): benchmarks/gpu_fast.sh OUTDIR
# Writes OUTDIR/{log.txt,build.log,transfer.json,transfer.md,transfer.png,gpu_tests.txt}.
# nvshmem4py: wheels in .whl/ (if present) are installed to /tmp/site first.
set -u
OUT=${1:?usage: benchmarks/gpu_fast.sh OUTDIR}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CP_OPS_EXT_DIR=${CP_OPS_EXT_DIR:-/tmp/cp_ops_ext}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"

echo "== build"; t0=$(date +%s)
timeout 150 python3 -c "
from cp_ops.transport import _fast_build as b
m, why = b.load(); print('build:', why or ('OK ' + m.__file__))" ; cp "$CP_OPS_EXT_DIR/build.log" "$OUT/build.log" 2>/dev/null
echo "build took $(( $(date +%s) - t0 )) s"

echo "== smoke (heap=${CP_OPS_FAST_HEAP:-nvshmem})"
if ! CP_OPS_FAST_POOL_GB=2 timeout 60 python3 benchmarks/transfer.py --sizes 4096 --iters 3 --paths ce; then
  echo "!! smoke with heap=${CP_OPS_FAST_HEAP:-nvshmem} failed; retrying with CP_OPS_FAST_HEAP=ipc"
  export CP_OPS_FAST_HEAP=ipc
  CP_OPS_FAST_POOL_GB=2 timeout 60 python3 benchmarks/transfer.py --sizes 4096 --iters 3 --paths ce
fi

echo "== benchmark"; t0=$(date +%s)
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/transfer.py --out "$OUT" --iters 25
echo "benchmark rc=$? took $(( $(date +%s) - t0 )) s"

echo "== GPU tests"; t0=$(date +%s)
CP_OPS_FAST_POOL_GB=2 timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_fast_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt"
echo "tests took $(( $(date +%s) - t0 )) s"
date -u
