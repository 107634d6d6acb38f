#!/usr/bin/env bash
# 2026-12-02 (sixth session), calls on one H200 (issue 21): the zero-communication bound's missing compile modes.
# Call 1 (default STEPS): Wan2.1-14B 480p and HunyuanVideo 544x960 under regional + graphs and regional, with cp_ops'
# cost. Call 2 (STEPS="host eg_flux eg_zimage eg_qwen eg_ltx eg_wan qwen_r wan_r zimage_full"): host µs per compiled
# call on the GPU host, whole-forward capture (eager + graphs) of the image models, LTX-Video and Wan2.1-1.3B, the
# `regional` rows of Qwen-Image and Wan2.1-1.3B, Z-Image-Turbo whole-model compile. Call 3 (STEPS="ltx_full
# flux_full ..."): whole-model compile (`full`) rows.
# Run from the repository root: OUT=... bash benchmarks/results/2026-12-02b_h200_torch2.11_cu130/call.sh
# Each step one process under `timeout` and a whole-call deadline END (s); results print to stdout (the log).
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
F="python3 benchmarks/fp8.py --sections models --no-bf16-check"
B="python3 -m cp_ops run"; R="--no-group1 --warmup 1 --repeats 3"
for s in ${STEPS:-wan14_rg hv_rg}; do case $s in
  wan14_rg) st $s 280 150 $B wan --config 14b --bound 2,4,8 --bound-compile regional+graphs,regional --cost $R --out $W/$s.json ;;
  hv_rg)    st $s 280 150 $B hunyuanvideo --bound 2,4,8 --bound-compile regional+graphs,regional --cost $R --out $W/$s.json ;;
  host)     st $s 130 60 python3 benchmarks/host_compiled.py --device cuda --breakdown --out $W/host ;;
  eg_flux)  st $s 90 40 $B flux --bound 2,4,8 --bound-compile eager+graphs --cost $R --out $W/$s.json ;;
  eg_zimage) st $s 80 30 $B zimage --bound 2,4,8 --bound-compile eager+graphs --cost $R --out $W/$s.json ;;
  eg_qwen)  st $s 110 50 $B qwenimage --bound 2,4,8 --bound-compile eager+graphs --cost $R --out $W/$s.json ;;
  eg_ltx)   st $s 70 30 $B ltx --bound 2,4,8 --bound-compile eager+graphs --cost $R --out $W/$s.json ;;
  eg_wan)   st $s 90 40 $B wan --config 1.3b --bound 2,4,8 --bound-compile eager+graphs --cost $R --out $W/$s.json ;;
  qwen_r)   st $s 120 60 $B qwenimage --bound 2,4,8 --bound-compile regional --cost $R --out $W/$s.json ;;
  wan_r)    st $s 110 60 $B wan --config 1.3b --bound 2,4,8 --bound-compile regional --cost $R --out $W/$s.json ;;
  zimage_full) st $s 90 20 $B zimage --bound 2,4,8 --bound-compile full $R --out $W/$s.json ;;
  ltx_full) st $s 280 120 $B ltx --bound ${LTXW:-2,4,8} --bound-compile full $R --out $W/$s.json ;;
  flux_full) st $s 300 150 $B flux --bound 2,4,8 --bound-compile full $R --out $W/$s.json ;;
  qwen_full) st $s 300 150 $B qwenimage --bound 2,4,8 --bound-compile full $R --out $W/$s.json ;;
  wan_full) st $s 240 120 $B wan --config 1.3b --bound 2,4,8 --bound-compile full $R --out $W/$s.json ;;
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
ls -la "$W"
