#!/usr/bin/env bash
# 2026-12-02, calls on one H200 (issues 24 and 21). Call 1 (default STEPS): FP8 accuracy over the models' full
# denoising loops (emulated on a group of one, benchmarks/fp8.py models), then cp_ops' cost under regional + graphs
# for FLUX.1-dev and Z-Image-Turbo at W = 4, 8 with today's code forms (one traced Ulysses launch, per-shape mask
# buffers). Call 2 (STEPS="qwen_rg gtests"): Qwen-Image's cost after the masked-padding change (e883c47), the
# one-GPU tests. Call 4 (STEPS="fused zimage_r4 flux_r4 qwen_prof host"): the fused FP8 codec's tests and timings,
# the regional rows with the host column, Qwen-Image W = 8 profiled, host µs per compiled call on the GPU host.
# Run from the repository root: OUT=... bash benchmarks/results/2026-12-02_h200_torch2.11_cu130/call1.sh
# Each step one process under `timeout` and a whole-call deadline END (s); results print to stdout (the log).
set -u
: "${OUT:?OUT must name the output folder}"
T0=$SECONDS; END=${END:-560}; LOG=$OUT/log.txt; W=/tmp/w; mkdir -p "$W"
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
F="python3 benchmarks/fp8.py --sections models --no-bf16-check"
for s in ${STEPS:-fp8_flux fp8_qwen fp8_ltx fp8_wan flux_rg zimage_rg}; do case $s in
  # the standard step counts (issue 21 item 6): Flux / Qwen-Image 28, LTX-Video / Wan 50
  fp8_flux) st $s 80 40 $F --out $W/$s --models flux --steps 28 --variants agkv,e4m3,cachedit ;;
  fp8_qwen) st $s 110 60 $F --out $W/$s --models qwenimage --steps 28 --variants agkv,e4m3,cachedit ;;
  fp8_ltx)  st $s 70 35 $F --out $W/$s --models ltx --steps 50 --variants agkv,e4m3,cachedit ;;
  fp8_wan)  st $s 150 100 $F --out $W/$s --models wan --steps 50 --variants agkv,e4m3 ;;
  flux_rg)  st $s 110 70 python3 -m cp_ops run flux --bound 4,8 --bound-compile regional+graphs --cost --no-group1 --out $W/$s.json ;;
  zimage_rg) st $s 110 60 python3 -m cp_ops run zimage --bound 4,8 --bound-compile regional+graphs --cost --no-group1 --out $W/$s.json ;;
  qwen_rg)  st $s 170 90 python3 -m cp_ops run qwenimage --bound 2,4,8 --bound-compile regional+graphs --cost --no-group1 --out $W/$s.json ;;
  gtests)   st $s 100 40 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_one_gpu.py -k "not two_ranks" ;;
  fused)    st $s 100 40 env DEADLINE=95 bash benchmarks/gpu_fp8.sh $W/fp8 fused ;;
  zimage_r4) st $s 120 50 env TORCH_LOGS=recompiles python3 -m cp_ops run zimage --bound 4 --bound-compile regional --cost --no-group1 --warmup 1 --repeats 3 --profile $W/prof --out $W/$s.json ;;
  flux_r4)  st $s 130 60 python3 -m cp_ops run flux --bound 4 --bound-compile regional --cost --no-group1 --warmup 1 --repeats 3 --out $W/$s.json ;;
  qwen_prof) st $s 120 60 python3 -m cp_ops run qwenimage --bound 8 --bound-compile regional+graphs --cost --no-group1 --profile $W/prof --out $W/$s.json ;;
  host)     st $s 150 60 python3 benchmarks/host_compiled.py --device cuda --breakdown --entries --out $W/host ;;
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
PY
tar czf "$OUT/results.tgz" -C "$W" --exclude='trace_*' . ; ls -la "$OUT"
