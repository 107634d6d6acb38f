#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, benchmarks, logs and result files into OUT_DIR.
#   benchmarks/gpu_all.sh OUT_DIR [section ...]
#   sections: env tests bench wan wan_compile wan_fast overlap fast (default: all); one log, OUT_DIR/log.txt
#   also (not in the default): pipelined — tests/test_pipelined_gpu.py (-s: errors printed) + benchmarks/pipelined.py;
#   deps — install the wheels carried in .whl/ (diffusers, expecttest, nvshmem4py) into /tmp/site for the later steps;
#   cpu_suite — the CPU suite (or the files in $CPU_SUITE_TESTS) on this machine's torch (GPUs hidden), in the
#     background (joined at the end);
#   host — benchmarks/host_cost.py (host µs per attention call, per transport/mode/chunks/rank check) and
#     tests/test_graph_gpu.py (CUDA-graph capture: torch.cuda.graph and reduce-overhead, both transports)
# Expects torch with CUDA; diffusers/expecttest/nvshmem4py either installed or on PYTHONPATH
# (on the project's GPU machine: carried as wheels in .whl/, see README of the device tool).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_all.sh OUT_DIR [section ...]}; shift
SECTIONS=${*:-env tests bench wan wan_compile wan_fast overlap fast}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
cd "$ROOT"
status=0
step() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/log.txt"; local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"; [ "$rc" = 0 ] || status=1; }
bg=""
for s in $SECTIONS; do case $s in
  deps)  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
         export PYTHONPATH=$ROOT:/tmp/site CP_OPS_EXT_DIR=${CP_OPS_EXT_DIR:-/tmp/cp_ops_ext}
         python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)" 2>&1 | tee -a "$OUT/log.txt" ;;
  cpu_suite) ( CUDA_VISIBLE_DEVICES= timeout ${CPU_SUITE_TIMEOUT:-480} python3 -m pytest -q -m "not gpu" -p no:cacheprovider ${CPU_SUITE_TESTS:-} \
           > "$OUT/cpu_suite.txt" 2>&1; echo "cpu_suite rc=$?" >> "$OUT/cpu_suite.txt" ) & bg=$! ;;
  host)  step host python3 benchmarks/host_cost.py --nproc ${HOST_NPROC:-2} --profile ${HOST_PROFILE:-18} --out "$OUT"
         step graph_tests python3 -m pytest -q -s -m gpu tests/test_graph_gpu.py -p no:cacheprovider ;;
  env)   step env python3 -m cp_ops env
         nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true ;;
  tests) step gpu_tests python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_fast_gpu.py tests/test_stress.py \
           tests/test_graph_gpu.py -p no:cacheprovider ;;
  bench) step bench python3 -m cp_ops bench --no-progress --out "$OUT/bench.json" --plot "$OUT/bench.png" ;;
  wan)   step wan_ulysses python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode ulysses --transport torch --out "$OUT/wan_ulysses.json"
         step wan_agkv python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode agkv --transport torch --out "$OUT/wan_agkv.json"
         ;;
  wan_compile) step wan_compile python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode ulysses --transport torch --compile --warmup 2 --repeats 10 --out "$OUT/wan_ulysses_compile.json" ;;
  wan_fast) step wan_fast python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode ulysses --transport fast --out "$OUT/wan_ulysses_fast.json" ;;
  overlap) [ -f benchmarks/overlap_block.py ] && step overlap python3 benchmarks/overlap_block.py --out "$OUT" --max-minutes ${OVERLAP_MINUTES:-6} ;;
  fast)  [ -f benchmarks/gpu_fast.sh ] && step fast bash benchmarks/gpu_fast.sh "$OUT" ;;
  pipelined) step pipelined_tests python3 -m pytest -q -s -m gpu tests/test_pipelined_gpu.py -p no:cacheprovider
         step pipelined_bench python3 benchmarks/pipelined.py --out "$OUT" --nproc ${PIPELINED_NPROC:-2} \
           --max-minutes ${PIPELINED_MINUTES:-3.4} ;;
  *) echo "unknown section $s"; status=1 ;;
esac; done
if [ -n "$bg" ]; then wait "$bg"; tail -3 "$OUT/cpu_suite.txt"; grep -q "cpu_suite rc=0" "$OUT/cpu_suite.txt" || status=1; fi
exit $status
