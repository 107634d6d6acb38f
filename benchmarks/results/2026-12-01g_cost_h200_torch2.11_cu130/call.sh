#!/usr/bin/env bash
# 2026-12-01g (issue 21 item 4), one H200: cp_ops cost of Qwen-Image and FLUX.1-dev after the traced Ulysses pack and the key mask once per forward. One call runs the steps named in
# STEPS (in order) under a deadline: each step = one `cp-ops run MODEL --bound ...` process with its own time cap
# (never past END seconds from the start; a step with less than its minimum left is skipped), its JSON written
# by cp-ops after each compile mode, and after every step everything so far is packed into $OUT
# (results.tgz: JSONs + profile summaries; traces.tgz: Chrome traces; log.txt), so a step killed at its limit
# keeps the earlier ones. Run from the repository root: bash benchmarks/results/2026-12-01g_cost_h200_torch2.11_cu130/call.sh
# Env: OUT (required), STEPS (default: the call-1 list below), END (default 570 s), WHL (wheels folder, default .whl).
set -u
: "${OUT:?OUT must name the output folder}"
T0=$SECONDS; END=${END:-215}; W=/tmp/w; mkdir -p "$W/prof"; LOG=$OUT/log.txt
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
WHL=${WHL:-.whl}
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'diffusers', diffusers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
git_rev=$(cat .gpu_rev 2>/dev/null || echo unknown); echo "code: $git_rev" | tee -a "$LOG"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,memory.used --format=csv 2>&1 | tee -a "$LOG"
pack() {
  tar czf "$OUT/results.tgz.part" -C "$W" --exclude='trace_*' . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
  if ls "$W"/prof/trace_* >/dev/null 2>&1; then
    tar czf "$OUT/traces.tgz.part" -C "$W/prof" $(cd "$W/prof" && ls trace_*) && mv "$OUT/traces.tgz.part" "$OUT/traces.tgz"
  fi
}
# st NAME CAP_S MIN_S [ENV=VAL ...] -- MODEL ARGS...
st() {
  local name=$1 cap=$2 min=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$((END - (SECONDS - T0))); local lim=$((cap < left ? cap : left))
  if [ "$lim" -lt "$min" ]; then echo "=== $name: skipped (t=$((SECONDS - T0)) s: $left s left, needs $min)" | tee -a "$LOG"; return; fi
  echo "=== $name (t=$((SECONDS - T0)) s, limit $lim s): ${envs[*]} cp-ops run $*" | tee -a "$LOG"
  env "${envs[@]}" timeout -s ABRT -k 5 "$lim" python3 -m cp_ops run "$@" --out "$W/bound_$name.json" 2>&1 \
    | grep -v "^USDT" | tee -a "$LOG"
  echo "=== $name: rc=${PIPESTATUS[0]} at t=$((SECONDS - T0)) s" | tee -a "$LOG"
  pack
}
P="--profile $W/prof"
STEPS=${STEPS:-qwen_rg flux_rg zimage_rg}
for s in $STEPS; do case $s in
  # priority 1: Flux / Qwen-Image regional + graphs at W = 4, 8 with the written fake all-to-all; profiled (item 3)
  flux_rg)     st flux_rg 115 80 TORCH_LOGS=recompiles -- flux --bound 4,8 --bound-compile regional+graphs --cost --no-group1 $P ;;
  qwen_rg)     st qwen_rg 100 70 TORCH_LOGS=recompiles -- qwenimage --bound 4,8 --bound-compile regional+graphs --cost --no-group1 $P ;;
  zimage_rg)   st zimage_rg 110 60 -- zimage --bound 4,8 --bound-compile regional+graphs --cost --no-group1 $P ;;
  # priority 2: long video cases, eager, 1 round (no warm-up: each side's first call is its warm-up)
  wan14b_720p) st wan14b_720p 130 80 -- wan --config 14b --frames 21 --height 90 --width 160 --bound 2,4,8 \
                 --bound-compile eager --cost --no-group1 --warmup 0 --repeats 1 ;;
  hv_720p)     st hv_720p 200 125 -- hunyuanvideo --frames 33 --height 90 --width 160 --bound 2,4,8 \
                 --bound-compile eager --no-group1 --warmup 0 --repeats 1 ;;
  ltx)         st ltx 110 50 -- ltx --bound 2,4,8 --bound-compile eager,regional+graphs --cost --no-group1 ;;
  # call 2: the layout copies A/B (layout.wide), then the re-measured rows after the fixes (profiled)
  pack_ab)     echo "=== pack_ab (t=$((SECONDS - T0)) s)" | tee -a "$LOG"
               timeout -k 5 60 python3 benchmarks/results/2026-12-01e_h200_torch2.11_cu130/pack_ab.py "$W/pack_ab.json" 2>&1 \
                 | tee -a "$LOG"; pack ;;
  qwen_rg2)    st qwen_rg2 95 60 -- qwenimage --bound 4,8 --bound-compile regional+graphs --cost --no-group1 $P ;;
  flux_rg8)    st flux_rg8 80 55 -- flux --bound 8 --bound-compile regional+graphs --cost --no-group1 $P ;;
  *) echo "=== unknown step $s" | tee -a "$LOG" ;;
esac; done
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
pack; ls -la "$OUT" | tee -a "$LOG"
