#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, benchmarks, logs and result files into OUT_DIR.
#   benchmarks/gpu_all.sh OUT_DIR [section ...]
#   tests: every test marked gpu under tests/ (or the files in $GPU_TESTS);
#   sections: env tests bench wan wan_compile wan_fast overlap fast (default: all); one log, OUT_DIR/log.txt
#   also (not in the default): pipelined — the gpu-marked tests of tests/test_pipelined.py (-s: errors printed) + benchmarks/pipelined.py;
#   deps — install the wheels carried in .whl/ (diffusers, expecttest, nvshmem4py) into /tmp/site for the later steps;
#   cpu_suite — the CPU suite (or the files in $CPU_SUITE_TESTS) on this machine's torch (GPUs hidden), in the
#     background (joined at the end);
#   bench_graphs — cp-ops bench --graphs at 4K/8K (captured fast calls keep their pool buffers: small S only);
#   timeline — benchmarks/timeline.py (profiler timeline per mode/transport/chunks: attn, merge, comm, idle, overlap);
#   host — benchmarks/host_cost.py (host µs per attention call, per transport/mode/chunks/rank check, --profile);
#   wan11 — issue 11's measurements of `cp-ops run wan` (Wan2.1-1.3B config, latent 16x64x64 = 16x32x32 patches =
#     16384 tokens, bf16; CP degree = all visible GPUs or $WAN_NPROC): eager Ulysses/AGKV with diffusers' native CP
#     rows (--compare diffusers), --compile regional and full (compile time = first call), --cuda-graphs (eager
#     capture; compiled reduce-overhead, torch and fast transports), --steps 4 (eager, compiled, with diffusers'
#     rows), --profile (traces + per-layer breakdown in $OUT/wan11_profile), and Wan 14B --layers 4 at 75600 tokens
#     (latent 21x90x160 = 21x45x80 patches); JSON per run in $OUT/wan11_*.json
#   models — issue 10's rows: cp-ops run for zimage (1024²), flux (1008²), qwenimage, hunyuanvideo, eager and compiled;
#   uneven — the gpu-marked tests of tests/test_uneven.py (-s) + benchmarks/uneven.py (seq_lens / key_mask cost vs the even call)
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
# ONLY (a regex over step names) runs a subset; STEP_TIMEOUT (s, default 420) ends a step that hangs
step() { local name=$1; shift; [[ $name =~ ${ONLY:-.} ]] || return 0; echo "=== $name: $*"; local t0=$SECONDS
  timeout -k 10 ${STEP_TIMEOUT:-420} "$@" 2>&1 | tee -a "$OUT/log.txt"; local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"; [ "$rc" = 0 ] || status=1; }
bg=""
for s in $SECTIONS; do case $s in
  deps)  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
         export PYTHONPATH=$ROOT:/tmp/site CP_OPS_EXT_DIR=${CP_OPS_EXT_DIR:-/tmp/cp_ops_ext}
         python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)" 2>&1 | tee -a "$OUT/log.txt" ;;
  cpu_suite) ( CUDA_VISIBLE_DEVICES= timeout ${CPU_SUITE_TIMEOUT:-480} python3 -m pytest -q -m "not gpu" -p no:cacheprovider ${CPU_SUITE_TESTS:-} \
           > "$OUT/cpu_suite.txt" 2>&1; echo "cpu_suite rc=$?" >> "$OUT/cpu_suite.txt" ) & bg=$! ;;
  timeline) # where the GPU time of one attention call goes (benchmarks/timeline.py): per-class µs, idle, overlap
         step timeline python3 benchmarks/timeline.py --out "$OUT/timeline" --sizes ${TIMELINE_SEQS:-4096 16384} \
           --chunks ${TIMELINE_CHUNKS:-1 2 4} ${TIMELINE_ARGS:-} ;;
  host)  step host python3 benchmarks/host_cost.py --nproc ${HOST_NPROC:-2} --profile ${HOST_PROFILE:-18} --out "$OUT" ;;
  env)   step env python3 -m cp_ops env
         nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true ;;
  tests) step gpu_tests python3 -m pytest -q -rs -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider ;;
  bench) # issue 9 item 6: every S of the issue, both transports, the measured choice (auto) and each mode at chunks
         # 1, 2, 4; all visible GPUs (BENCH_NPROC to change); the measured choices land in OUT/choices.json
         step bench env CP_OPS_TUNE_CACHE="$OUT/choices.json" python3 -m cp_ops bench --no-progress \
           ${BENCH_NPROC:+--nproc $BENCH_NPROC} --seqs ${BENCH_SEQS:-4096,8192,16384,32768,75600} \
           --transports torch,fast --modes auto,agkv,ulysses --chunks ${BENCH_CHUNKS:-1,2,4} \
           --out "$OUT/bench.json" --plot "$OUT/bench.png" ;;
  bench_graphs) # the small S again, each case also replayed from a CUDA graph (no host launch cost): --graphs
         step bench_graphs python3 -m cp_ops bench --no-progress ${BENCH_NPROC:+--nproc $BENCH_NPROC} \
           --seqs ${BENCH_GRAPH_SEQS:-4096,8192} --transports torch,fast --modes auto,agkv,ulysses --chunks 1,2 --graphs \
           --out "$OUT/bench_graphs.json" --plot "$OUT/bench_graphs.png" ;;
  wan)   step wan_ulysses python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode ulysses --transport torch --out "$OUT/wan_ulysses.json"
         step wan_agkv python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode agkv --transport torch --out "$OUT/wan_agkv.json"
         ;;
  wan11) W11="python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 ${WAN_NPROC:+--nproc $WAN_NPROC}"
         step wan11_eager_ulysses $W11 --mode ulysses --transport torch --compare diffusers --out "$OUT/wan11_eager_ulysses.json"
         step wan11_eager_agkv $W11 --mode agkv --transport torch --out "$OUT/wan11_eager_agkv.json"
         step wan11_eager_fast_ulysses $W11 --mode ulysses --transport fast --out "$OUT/wan11_eager_fast_ulysses.json"
         step wan11_eager_fast_agkv $W11 --mode agkv --transport fast --out "$OUT/wan11_eager_fast_agkv.json"
         step wan11_profile $W11 --mode ulysses --transport torch --warmup 3 --repeats 5 --profile "$OUT/wan11_profile" \
           --out "$OUT/wan11_profile.json"
         step wan11_compile_regional $W11 --mode ulysses --transport torch --compile regional --warmup 2 --repeats 10 \
           --compare diffusers --out "$OUT/wan11_compile_regional.json"
         step wan11_compile_fast_agkv $W11 --mode agkv --transport fast --compile regional --warmup 2 --repeats 10 \
           --out "$OUT/wan11_compile_fast_agkv.json"
         step wan11_compile_fast_ulysses $W11 --mode ulysses --transport fast --compile regional --warmup 2 --repeats 10 \
           --out "$OUT/wan11_compile_fast_ulysses.json"
         step wan11_compile_full $W11 --mode ulysses --transport torch --compile full --warmup 2 --repeats 10 \
           --out "$OUT/wan11_compile_full.json"
         step wan11_graphs_eager $W11 --mode ulysses --transport torch --cuda-graphs --out "$OUT/wan11_graphs_eager.json"
         step wan11_graphs_eager_fast_agkv $W11 --mode agkv --transport fast --cuda-graphs \
           --out "$OUT/wan11_graphs_eager_fast_agkv.json"
         step wan11_graphs_compiled $W11 --mode ulysses --transport torch --compile --cuda-graphs --warmup 2 --repeats 10 \
           --out "$OUT/wan11_graphs_compiled.json"
         step wan11_graphs_compiled_fast $W11 --mode ulysses --transport fast --compile --cuda-graphs --warmup 2 --repeats 10 \
           --out "$OUT/wan11_graphs_compiled_fast.json"
         step wan11_steps_eager $W11 --mode ulysses --transport torch --steps 4 --compare diffusers --out "$OUT/wan11_steps_eager.json"
         step wan11_steps_compiled $W11 --mode ulysses --transport torch --steps 4 --compile --out "$OUT/wan11_steps_compiled.json"
         step wan11_14b python3 -m cp_ops run wan --config 14b --layers 4 --frames 21 --height 90 --width 160 \
           ${WAN_NPROC:+--nproc $WAN_NPROC} --mode ulysses --transport torch --warmup 2 --repeats 5 --out "$OUT/wan11_14b.json"
         ;;
  wan_compile) step wan_compile python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode ulysses --transport torch --compile --warmup 2 --repeats 10 --out "$OUT/wan_ulysses_compile.json" ;;
  wan_fast) step wan_fast python3 -m cp_ops run wan --config 1.3b --frames 16 --height 64 --width 64 \
           --mode ulysses --transport fast --out "$OUT/wan_ulysses_fast.json" ;;
  overlap) [ -f benchmarks/overlap_block.py ] && step overlap python3 benchmarks/overlap_block.py --out "$OUT" --max-minutes ${OVERLAP_MINUTES:-6} ;;
  fast)  [ -f benchmarks/gpu_fast.sh ] && step fast bash benchmarks/gpu_fast.sh "$OUT" ;;
  pipelined) step pipelined_tests python3 -m pytest -q -s -m gpu tests/test_pipelined.py -p no:cacheprovider
         step pipelined_bench python3 benchmarks/pipelined.py --out "$OUT" --nproc ${PIPELINED_NPROC:-2} \
           --max-minutes ${PIPELINED_MINUTES:-3.4} ;;
  models) # issue 10's GPU rows: each model at its released config (--layers ${MODEL_LAYERS:-2} blocks of each kind),
         # CP over all visible GPUs, eager and compiled; Z-Image at 1024² and Flux at 1008² (latent = pixels / 8; 1008²
         # gives 3969 tokens: uneven shards on CP2), Qwen-Image 1024², HunyuanVideo latent 16x64x64
         for m in "zimage --height 128 --width 128" "flux --height 126 --width 126" "qwenimage --height 128 --width 128" \
                  "hunyuanvideo"; do
           n=${m%% *}
           for c in "" "--compile"; do
             step "model_${n}${c:+_compiled}" python3 -m cp_ops run $m --layers ${MODEL_LAYERS:-2} --warmup 3 --repeats 10 \
               $c --out "$OUT/model_${n}${c:+_compiled}.json"
           done
         done ;;
  uneven) step uneven_tests python3 -m pytest -q -s -m gpu tests/test_uneven.py -p no:cacheprovider
         step uneven_bench python3 benchmarks/uneven.py --out "$OUT" --nproc ${UNEVEN_NPROC:-2} ;;
  *) echo "unknown section $s"; status=1 ;;
esac; done
if [ -n "$bg" ]; then wait "$bg"; tail -3 "$OUT/cpu_suite.txt"; grep -q "cpu_suite rc=0" "$OUT/cpu_suite.txt" || status=1; fi
exit $status
