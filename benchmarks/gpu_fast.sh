#!/usr/bin/env bash
# Fast transport on the GPU machine: build the extension, run the GPU tests (fast + foundation), optionally
# the transfer benchmark. Usage (repo root): benchmarks/gpu_fast.sh OUTDIR [tests] [bench]
# Writes OUTDIR/{log.txt,build.log,gpu_tests.txt[,transfer.json,transfer.md,transfer.png]}.
# nvshmem4py: wheels in .whl/ (if present) are installed to /tmp/pydeps first.
set -u
OUT=${1:?usage: benchmarks/gpu_fast.sh OUTDIR [tests] [bench]}; shift
SECTIONS=${*:-tests bench}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CP_OPS_EXT_DIR=${CP_OPS_EXT_DIR:-/tmp/cp_ops_ext}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pydeps .whl/*.whl \
    && export PYTHONPATH=/tmp/pydeps:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"

echo "== build"; t0=$(date +%s)
timeout 240 python3 -c "
from cp_ops import _ext as b
m, why = b.load(); print('build:', why or ('OK ' + m.__file__))"
cp "$CP_OPS_EXT_DIR/build.log" "$OUT/build.log" 2>/dev/null
echo "build took $(( $(date +%s) - t0 )) s"

for s in $SECTIONS; do case $s in
  tests)
    echo "== GPU tests"; t0=$(date +%s)
    CP_OPS_FAST_POOL_GB=2 timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -s \
      tests/test_fast.py tests/test_attention.py::test_cuda_attention_bitwise_equal_single_gpu \
      tests/test_attention.py::test_cuda_compiled_equals_eager --durations=12 2>&1 | tee "$OUT/gpu_tests.txt"
    echo "tests took $(( $(date +%s) - t0 )) s" ;;
  bench)
    echo "== transfer benchmark"; t0=$(date +%s)
    timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/transfer.py --out "$OUT" --iters ${BENCH_ITERS:-25} ${BENCH_ARGS:-}
    echo "benchmark rc=$? took $(( $(date +%s) - t0 )) s" ;;
  *) echo "unknown section $s" ;;
esac; done
date -u
