#!/usr/bin/env bash
# Everything one GPU can prove, in one call on the GPU machine (1x H200):
#   benchmarks/gpu_one.sh OUT_DIR [section ...]      sections: build tests host bound (default: all)
#   build — the CUDA extension (nvcc; csrc/) built and loaded;
#   tests — the GPU-marked tests that need one GPU (tests/test_one_gpu.py: two ranks sharing the GPU over gloo vs one
#           device, a fake group's variants eager/compiled/captured; the CUDA and Triton LSE merge; the fast
#           transport's capture/free/capture on a group of 1, tests/test_fast.py; the pass rollback tests on this torch);
#   host  — host µs per eager cp_ops.attention call, benchmarks/host_cost.py --fake, this tree and, when .base/ holds
#           an older checkout, that one too, interleaved (before/after a change);
#   bound — the zero-communication bound of a few full-size models (BOUND_STEPS; benchmarks/gpu_bound.sh).
# Wheels in .whl/ (diffusers, importlib_metadata, expecttest, nvshmem4py) go to /tmp/site first, once: the bound
# section's gpu_bound.sh finds them there (benchmarks/gpu_site.sh).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_one.sh OUT_DIR [section ...]}; shift
SECTIONS=${*:-build tests host bound}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CP_OPS_EXT_DIR=${CP_OPS_EXT_DIR:-/tmp/cp_ops_ext}
. "$ROOT/benchmarks/gpu_site.sh"  # the wheels into /tmp/site, once (a caller that did it is not repeated)
mkdir -p "$OUT"
LOG=$OUT/log.txt
status=0
step() { local name=$1 limit=$2; shift 2; echo "=== $name: $*" | tee -a "$LOG"; local t=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | grep -v "^USDT" | tee -a "$LOG"; local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t)) s" | tee -a "$LOG"; [ "$rc" = 0 ] || status=1; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  2>&1 | tee -a "$LOG"
for s in $SECTIONS; do case $s in
  build) step build 240 python3 -c "from cp_ops.transport import _fast_build as b; ext, why = b.load(); print('extension:', ext, why); assert ext is not None" ;;
  tests) step tests "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_one_gpu.py tests/test_fast.py -k "one_gpu or merge or two_ranks or fake_group" ;
         step pass_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_pass_rollback.py tests/test_csrc_compiles.py ;;
  host)  step host_new 90 python3 benchmarks/host_cost.py --fake --nproc 2 --calls 2000 --out "$OUT/host_new"
         if [ -d .base/cp_ops ]; then
           (cd .base && step host_old 90 env PYTHONPATH="$ROOT/.base:/tmp/site" python3 benchmarks/host_cost.py --fake \
              --nproc 2 --calls 2000 --out "$OUT/host_old")
           step host_new2 90 python3 benchmarks/host_cost.py --fake --nproc 2 --calls 2000 --out "$OUT/host_new2"
         fi ;;
  bound) DEADLINE=${BOUND_DEADLINE:-200} BOUND_W=${BOUND_W:-2,4,8} STEP_TIMEOUT=${BOUND_STEP_TIMEOUT:-150} \
           bash benchmarks/gpu_bound.sh "$OUT/bound" ${BOUND_STEPS:-zimage@eager wan:1.3b@regional+graphs} \
           || status=1 ;;
esac; done
exit $status
