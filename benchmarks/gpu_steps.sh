# The named GPU steps behind the measured claims (benchmarks/results/*/README.md names the steps of each), run from the
# repository root: OUT=DIR STEPS="step ..." bash benchmarks/gpu_steps.sh (or sourced by a call script). Needs OUT (the
# output folder) and STEPS (step names, run in order); END (s, default 560) is the whole call's deadline. Each step is
# one process under `timeout` (its cap, or what is left of END; skipped when less than its minimum is left); output
# goes to $OUT/log.txt, per-run JSON to $OUT/json/STEP.json.
# FW (W list, default 2,4,8) and FCAP (cap, s) tune the whole-model-compile steps (*_full): 1.5-2.5 min of compile
# per side on an H200 (FLUX.1-dev: 109 s diffusers, 99 / 120 / 136 s at W = 2 / 4 / 8, one after another); CW
# (--compile-workers: sides compiled at once in child processes first, each with its own copy of the weights on the
# GPU; default 4, Wan2.1-14B / HunyuanVideo 3; Qwen-Image 0: two workers run out of memory) overlaps them.
# After the workers the run's own first call per side still takes ~37 s at full depth (Dynamo and AOT tracing; the FX
# graph cache hits): a video DiT's four sides do not fit one 10-minute call.
set -u
: "${OUT:?OUT must name the output folder}"
T0=$SECONDS; END=${END:-560}; LOG=$OUT/log.txt; W=$OUT/json; mkdir -p "$W"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ROOT=$PWD; . benchmarks/gpu_site.sh
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'diffusers', diffusers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
echo "code: $(cat .gpu_rev 2>/dev/null || echo unknown)" | tee -a "$LOG"
# st NAME CAP_S MIN_S CMD...
st() {
  local name=$1 cap=$2 min=$3; shift 3
  local left=$((END - (SECONDS - T0))); local lim=$((cap < left ? cap : left))
  if [ "$lim" -lt "$min" ]; then echo "=== $name: skipped (t=$((SECONDS - T0)) s: $left s left, needs $min)" | tee -a "$LOG"; return; fi
  echo "=== $name (t=$((SECONDS - T0)) s, limit $lim s): $*" | tee -a "$LOG"
  timeout -s ABRT -k 5 "$lim" "$@" 2>&1 | grep -v "^USDT\|__recompiles\]     -" | tee -a "$LOG"
  echo "=== $name: rc=${PIPESTATUS[0]} at t=$((SECONDS - T0)) s" | tee -a "$LOG"
}
B="python3 -m cp_ops bound"; R="--no-group1 --warmup 1 --repeats 3"; RC="--compile-modes regional+capture,regional+graphs --cost"
PT="python3 -m pytest -q -rs -p no:cacheprovider"; PEERS=${PEERS:-diffusers,paraattn,xdit,cache-dit}
for s in ${STEPS:?STEPS names the steps}; do case $s in
  # GPU tests: whole-forward capture and one-GPU tests (fake group, the extension's merge); two ranks on one GPU; FP8's fused Triton kernels with a fresh
  # Triton cache (their first-use check); CPU tests of compiled uneven shards under this machine's torch
  tests)     st $s 240 60 $PT -m gpu tests/test_captured.py tests/test_one_gpu.py -k "not two_ranks" ;;
  t2r)       st $s 120 60 $PT -m gpu tests/test_one_gpu.py tests/test_fp8.py -k two_ranks ;;
  fp8f)      st $s 120 40 env TRITON_CACHE_DIR="$(mktemp -d)" $PT -m gpu tests/test_fp8.py -k "fused or nonfinite" ;;
  tcpu)      st $s 240 60 $PT tests/test_uneven.py tests/test_diffusers_models.py -k "test_compiled_equals_eager or (unparallelized and 4)" ;;
  # bound rows (zero-communication bound, fake group): regional+capture beside regional+graphs, with cp_ops' cost
  rc_flux)   st $s 170 80 $B flux --worlds 2,4,8 $RC $R --out $W/$s.json ;;
  rc_zimage) st $s 140 70 $B zimage --worlds 2,4,8 $RC $R --out $W/$s.json ;;
  rc_wan)    st $s 150 70 $B wan --config 1.3b --worlds 2,4,8 $RC $R --out $W/$s.json ;;
  rc_ltx)    st $s 130 60 $B ltx --worlds 2,4,8 $RC $R --out $W/$s.json ;;
  rc_qwen)   st $s 150 70 $B qwenimage --worlds 2,4,8 $RC $R --out $W/$s.json ;;
  flux_unev) st $s 200 80 $B flux --height 126 --worlds 2,4,8 $RC $R --out $W/$s.json ;;
  wan14_rc)  st $s 260 120 $B wan --config 14b --worlds 2,4,8 --compile-modes regional+capture --cost $R --out $W/$s.json ;;
  hv_rc)     st $s 290 120 $B hunyuanvideo --worlds 2,4,8 --compile-modes regional+capture --cost $R --out $W/$s.json ;;
  # diffusers' own CP beside cp_ops (eager and per-block graphs; one capture of the whole forward)
  cmp_flux)  st $s 240 90 $B flux --worlds 2,4,8 --compile-modes eager,regional+graphs --compare diffusers $R --out $W/$s.json ;;
  cmp_flux_rc) st $s 200 90 $B flux --worlds 2,4,8 --compile-modes regional+capture --compare diffusers $R --out $W/$s.json ;;
  # the peers beside cp_ops (cp-ops bound --compare: diffusers, para-attn, xDiT, cache-dit; their wheels in .whl_peers/):
  # their outputs vs one device (two ranks sharing the GPU), then eager and the whole forward captured at W = 2, 4, 8,
  # per-block graphs at W = 4 (every compiled side compiles its blocks: one W keeps it in a call)
  tpeers)    st $s 300 60 $PT -m gpu tests/test_one_gpu_peers.py ;;
  tstaged)   st $s 240 60 $PT -m gpu tests/test_staged_pg.py tests/test_one_gpu_peers.py -k staged ;;
  peers_flux) st $s 400 120 $B flux --worlds ${PW:-2,4,8} --compile-modes eager,eager+graphs --compare $PEERS $R --out $W/$s.json ;;
  peers_flux_rg) st $s 400 150 $B flux --worlds ${PW:-4} --compile-modes regional+graphs --compare $PEERS $R --out $W/$s.json ;;
  peers_wan) st $s 300 90 $B wan --config 1.3b --worlds ${PW:-2,4,8} --compile-modes eager,eager+graphs --compare $PEERS $R --out $W/$s.json ;;
  peers_qwen) st $s 300 90 $B qwenimage --worlds ${PW:-2,4,8} --compile-modes eager,eager+graphs --compare $PEERS $R --out $W/$s.json ;;
  # GPU memory of parallelize's default (the whole forward captured) beside eager, full size, one copy at a time
  mem_qwen)  st $s 240 90 python3 benchmarks/capture_memory.py --models qwenimage --out $W/$s.json ;;
  # the whole forward captured without compile (eager + graphs), with cp_ops' cost
  eg_qwen)   st $s 150 60 $B qwenimage --worlds 2,4,8 --compile-modes eager+graphs --cost $R --out $W/$s.json ;;
  eg_flux_unev) st $s 110 40 $B flux --height 126 --worlds 2,4,8 --compile-modes eager+graphs --cost $R --out $W/$s.json ;;
  eg_wan14)  st $s 220 90 $B wan --config 14b --worlds 2,4,8 --compile-modes eager+graphs --cost $R --out $W/$s.json ;;
  eg_hv)     st $s 220 90 $B hunyuanvideo --worlds 2,4,8 --compile-modes eager+graphs --cost $R --out $W/$s.json ;;
  # where the host time of a compiled forward without graphs goes (cp_ops' Ulysses vs plain attention, one profiled forward)
  prof_flux) st $s 200 90 $B flux --worlds 4 --compile-modes regional --cost --profile $W/prof_$s $R --out $W/$s.json ;;
  # Dynamo's recompiles of a whole-model compile after its first call, at reduced depth (a diagnostic: no rows)
  recomp)    st $s 200 60 env TORCH_LOGS=recompiles $B flux --layers 2 --worlds 2,4,8 --compile-modes full $R --out $W/$s.json ;;
  # whole-model compile (no graphs)
  flux_full) st $s ${FCAP:-300} 150 $B flux --worlds ${FW:-2,4,8} --compile-modes full --compile-workers ${CW:-4} $R --out $W/$s.json ;;
  zimage_full) st $s ${FCAP:-300} 150 $B zimage --worlds ${FW:-2,4,8} --compile-modes full --compile-workers ${CW:-4} $R --out $W/$s.json ;;
  qwen_full) st $s ${FCAP:-300} 150 $B qwenimage --worlds ${FW:-2,4,8} --compile-modes full --compile-workers ${CW:-0} $R --out $W/$s.json ;;
  wan_full)  st $s ${FCAP:-300} 150 $B wan --config 1.3b --worlds ${FW:-2,4,8} --compile-modes full --compile-workers ${CW:-4} $R --out $W/$s.json ;;
  wan14_full) st $s ${FCAP:-300} 150 $B wan --config 14b --worlds ${FW:-4} --compile-modes full --compile-workers ${CW:-3} $R --out $W/$s.json ;;
  hv_full)   st $s ${FCAP:-300} 150 $B hunyuanvideo --worlds ${FW:-4} --compile-modes full --compile-workers ${CW:-3} $R --out $W/$s.json ;;
  # whole-model compile, every side in its own process (--side-processes: built at once, one copy of the weights each;
  # no second trace in this process): Wan2.1-14B's 4 sides (4 x 28 GB), HunyuanVideo's W = 2, 8 (3 x 26 GB)
  wan14_fullp) st $s ${FCAP:-580} 150 $B wan --config 14b --worlds ${FW:-2,4,8} --compile-modes full --side-processes $R --out $W/$s.json ;;
  hv_fullp)  st $s ${FCAP:-580} 150 $B hunyuanvideo --worlds ${FW:-2,8} --compile-modes full --side-processes $R --out $W/$s.json ;;
  ltx_full)  st $s ${FCAP:-280} 120 $B ltx --worlds ${FW:-4} --compile-modes full --compile-workers ${CW:-4} $R --out $W/$s.json ;;
  # 720p (issue 21's long cases), regional+capture with --cost: Wan2.1-14B 720p/81 f (75,600 tokens; one GPU ~12 s per
  # forward); HunyuanVideo 720p/129 f (118,800 tokens; one GPU 31.5 s eager, 01e) with one untimed forward less and
  # one round (its sides' forwards alone fill a call otherwise)
  wan14_720p) st $s ${FCAP:-540} 200 $B wan --config 14b --frames 21 --height 90 --width 160 --worlds ${FW:-2,4,8} --compile-modes regional+capture --cost $R --out $W/$s.json ;;
  hv_720p)   st $s ${FCAP:-540} 240 $B hunyuanvideo --frames 33 --height 90 --width 160 --worlds ${FW:-2,4,8} --compile-modes regional+capture --cost --no-group1 --warmup 0 --repeats 1 --out $W/$s.json ;;
  *) echo "=== unknown step $s" | tee -a "$LOG" ;;
esac; done
python3 - "$W" <<'PY' 2>&1 | tee -a "$LOG"
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):  # the profile summaries (busy ms by category, top kernels)
    d = json.load(open(f))
    for mode, sides in (d.get("profiles") or {}).items():
        for side, p in sides.items():
            print(f"PROFILE {f.rsplit('/', 1)[-1]} {mode} {side}: wall {p['wall_ms']:.2f} busy {p['busy_ms']:.2f} "
                  + " ".join(f"{k}={v:.2f}" for k, v in sorted(p['by_category'].items())))
            for name, ms, n in p["top"][:8]:
                print(f"    {ms:8.3f} ms {n:5d}x {name[:100]}")
            if "host_ms" in p:  # self CPU time per host event (since 2026-12-02f)
                print(f"  host: {p['host_ms']:.2f} ms self CPU")
                for name, ms, n in p["host_top"][:10]:
                    print(f"    {ms:8.3f} ms {n:5d}x {name[:100]}")
PY
ls -la "$W"
