#!/usr/bin/env bash
# Everything one GPU can prove, in one call on the GPU machine (1x H200):
#   benchmarks/gpu_one.sh OUT_DIR [section ...]      sections: build tests host bound shared wan sharebench nvshmem
#                                                     (default: build tests host bound)
#   build — the CUDA extension (nvcc; csrc/) built and loaded;
#   tests — the GPU-marked tests that need one GPU (tests/test_one_gpu.py: two ranks sharing the GPU over gloo vs one
#           device, a fake group's variants eager/compiled/captured; the CUDA and Triton LSE merge; the fast
#           transport's capture/free/capture on a group of 1, tests/test_fast.py; the pass rollback tests on this torch);
#   host  — host µs per eager cp_ops.attention call, benchmarks/host_cost.py --fake, this tree and, when .base/ holds
#           an older checkout, that one too, interleaved (before/after a change);
#   bound — the zero-communication bound of a few full-size models (BOUND_STEPS; benchmarks/gpu_bound.sh);
#   shared — W = 2, 4, 8 ranks sharing the GPU (tests/test_one_gpu.py: every mode, both transports and heaps, eager,
#           compiled, captured, 200 calls, parallelize eager and captured), records merged into OUT_DIR/shared_device.json;
#   wan   — parallelize full-depth Wan2.1-1.3B at 480p, W = 2, 4, 8, ranks sharing the GPU (same JSON);
#   wansteps — the same Wan, 4 denoising steps: eager / + FirstBlockCache / compile=True (+ cuda_graphs="forward" on
#           fast), W = 2, 4, 8 (same JSON);
#   flux  — parallelize Flux-dev at the depth 8 copies fit the GPU, 4 denoising steps, eager / + FirstBlockCache /
#           compile=True (+ cuda_graphs="forward" on fast), W = 2, 4, 8 (same JSON);
#   faults — a peer that never arrives, a killed rank (tests/test_one_gpu.py) and tests/test_one_gpu_faults.py (an
#           exception between launch and wait, the go-ahead gate, 10 whole-forward graphs freed and recaptured, two
#           streams) (same JSON);
#   sharebench — cp-ops bench --device shared (its times are no speed numbers: the run checks the outputs);
#   nvshmem — whether NVSHMEM starts W PEs on one GPU under CUDA MPS (a daemon started and stopped here);
#   peers — other libraries' CP beside cp_ops (wheels in .whl_peers/): their outputs vs one device, then their bound
#           (cp-ops bound --compare; PEERS_STEPS of benchmarks/gpu_steps.sh, default "tpeers peers_flux"), JSON in
#           OUT_DIR/peers/json/ (benchmarks/results/peers/).
# A section may name its world sizes: shared:w8, wan:w2,w4 (pytest -k "<section's tests> and (w2 or w4)").
# Lanes: an argument holding '/' runs its parts at once (each part: sections joined by '+', in order, logged to
# OUT_DIR/log_<n>.txt), e.g.  build 'shared:w2,w4+faults/shared:w8+sharebench/wan'  (keep the parts that hold big
# models -- wan, flux -- in one lane: 8 copies of each fill most of one GPU).
# END (seconds since the start, default none): no step runs past it (each step's limit is cut to what is left; a step
# with less than 20 s left is skipped and says so).
# Ranks sharing a device print no timings as speed numbers: their records say passed / max_err only.
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
T0=$SECONDS
export TEST_SHARED_DEVICE_OUT=${TEST_SHARED_DEVICE_OUT:-/tmp/shared_device}
mkdir -p "$TEST_SHARED_DEVICE_OUT"
status=0
step() { local name=$1 limit=$2; shift 2
  if [ -n "${END:-}" ]; then local left=$((END - (SECONDS - T0) - 5))
    if [ "$left" -lt 20 ]; then echo "=== $name: skipped (END=$END s: ${left} s left)" | tee -a "$LOG"; status=1; return; fi
    [ "$left" -lt "$limit" ] && limit=$left; fi
  echo "=== $name: $* (limit $limit s)" | tee -a "$LOG"; local t=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | grep -v "^USDT" | tee -a "$LOG"; local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t)) s" | tee -a "$LOG"; [ "$rc" = 0 ] || status=1; }
ptest() { local name=$1 limit=$2; shift 2; step "$name" "$limit" python3 -m pytest -q -rs -p no:cacheprovider "$@"; }
kw() { [ -z "$2" ] && { echo "$1"; return; }; echo "$1 and (${2//,/ or })"; }  # kw 'wan_full' 'w2,w4'
merge() { python3 - "$TEST_SHARED_DEVICE_OUT" "$OUT/shared_device.json" <<'PY' 2>&1 | tee -a "$LOG"
import glob, json, os, sys
recs = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(f))
    recs += r if isinstance(r, list) else [r]
json.dump(recs, open(sys.argv[2], "w"), indent=1)
for r in recs:
    err = "" if r.get("max_err") is None else f"{r['max_err']:.3g}"
    print(f"{r['world_size']} {r['transport']:<5} {str(r.get('heap')):<7} {'ok  ' if r['passed'] else 'FAIL'} {err:>9}  "
          f"{r['what']}  {r.get('error', '')}")
print(f"{sum(r['passed'] for r in recs)}/{len(recs)} checks passed")
PY
}
section() { local s=${1%%:*} w=""; [ "$1" != "$s" ] && w=${1#*:}
  case $s in
  build) step build 240 python3 -c "from cp_ops import _ext as b; ext, why = b.load(); print('extension:', ext, why); assert ext is not None" ;;
  tests) step tests "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -rs -p no:cacheprovider \
           tests/test_one_gpu.py::test_two_ranks_on_one_gpu_over_gloo_equal_one_device \
           tests/test_one_gpu.py::test_fake_group_eager_compiled_and_captured \
           tests/test_one_gpu.py::test_extension_merge_matches_the_fp32_reference_and_triton \
           tests/test_fast.py::test_capture_destroy_capture_ten_graphs_one_gpu ;
         step pass_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_pass_rollback.py tests/test_csrc_compiles.py ;;
  host)  step host_new 90 python3 benchmarks/host_cost.py --fake --nproc 2 --calls 2000 --out "$OUT/host_new"
         if [ -d .base/cp_ops ]; then
           (cd .base && step host_old 90 env PYTHONPATH="$ROOT/.base:/tmp/site" python3 benchmarks/host_cost.py --fake \
              --nproc 2 --calls 2000 --out "$OUT/host_old")
           step host_new2 90 python3 benchmarks/host_cost.py --fake --nproc 2 --calls 2000 --out "$OUT/host_new2"
         fi ;;
  shared) TEST_SHARED_DEVICE_ONLY=${SHARED_ONLY:-} ptest "shared${w:+_$w}" "${SHARED_TIMEOUT:-480}" tests/test_one_gpu.py \
           -k "$(kw "${SHARED_K:-shared_device}" "$w")" ;;  # SHARED_ONLY: a substring of the checks to run
  wan)   ptest "wan${w:+_$w}" "${WAN_TIMEOUT:-300}" tests/test_one_gpu.py -k "$(kw "${WAN_K:-wan_full}" "$w")" ;;
  wansteps) ptest "wansteps${w:+_$w}" "${WANSTEPS_TIMEOUT:-540}" tests/test_one_gpu.py -k "$(kw "${WANSTEPS_K:-wan_steps}" "$w")" ;;
  flux)  ptest "flux${w:+_$w}" "${FLUX_TIMEOUT:-420}" tests/test_one_gpu.py -k "$(kw "${FLUX_K:-flux_dev}" "$w")" ;;
  faults) ptest faults "${FAULTS_TIMEOUT:-240}" tests/test_one_gpu.py tests/test_one_gpu_faults.py \
           -k "${FAULTS_K:-never_arrives or killed or test_one_gpu_faults}" ;;
  sharebench) step sharebench 150 python3 -m cp_ops bench --device shared --nproc "${SHAREBENCH_W:-2}" --seqs 8192 \
                --modes agkv,ulysses --transports torch,fast --chunks 1,2 --warmup 1 --repeats 1 ;;
  nvshmem) if [ -n "${END:-}" ] && [ $((END - (SECONDS - T0))) -lt 60 ]; then
           echo "=== nvshmem_mps: skipped (END=$END s: no MPS daemon started)" | tee -a "$LOG"; status=1; return; fi
         mkdir -p /tmp/mps_pipe /tmp/mps_log
         export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
         nvidia-cuda-mps-control -d 2>&1 | tee -a "$LOG"
         TEST_SHARED_DEVICE_TAG=+mps ptest "nvshmem_mps${w:+_$w}" "${MPS_TIMEOUT:-240}" tests/test_one_gpu.py \
           -k "$(kw "${MPS_K:-shared_device and nvshmem}" "$w")"
         echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
         tail -5 /tmp/mps_log/control.log 2>/dev/null | tee -a "$LOG" ;;
  peers) (OUT=$OUT/peers END=${PEERS_END:-540} STEPS="${PEERS_STEPS:-tpeers peers_flux}" bash benchmarks/gpu_steps.sh) \
           || status=1 ;;
  bound) DEADLINE=${BOUND_DEADLINE:-200} BOUND_W=${BOUND_W:-2,4,8} STEP_TIMEOUT=${BOUND_STEP_TIMEOUT:-150} \
           bash benchmarks/gpu_bound.sh "$OUT/bound" ${BOUND_STEPS:-zimage@eager wan:1.3b@regional+graphs} \
           || status=1 ;;
  *) echo "=== unknown section $1" | tee -a "$LOG"; status=1 ;;
  esac; }
lane() { local s; for s in ${1//+/ }; do section "$s"; done; return $status; }
for arg in $SECTIONS; do
  if [[ $arg == */* ]]; then  # lanes at once, each logged to its own file
    pids=(); n=0
    for part in ${arg//\// }; do n=$((n + 1)); (LOG=$OUT/log_$n.txt; echo "=== lane $n: $part" | tee -a "$LOG"; lane "$part") &
      pids+=($!); done
    for p in "${pids[@]}"; do wait "$p" || status=1; done
  else lane "$arg" || status=1; fi
done
merge
exit $status
