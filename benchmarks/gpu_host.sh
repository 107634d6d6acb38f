#!/usr/bin/env bash
# Where the host time of `--compile-modes regional` goes on ONE GPU (docs/measuring.md, "regional without graphs at
# W >= 4"), one call:   OUT=DIR bash benchmarks/gpu_host.sh
# Steps (each one process under `timeout`, never past END seconds from the start; a step with less than its minimum
# left is skipped; everything so far is copied to $OUT after each step):
#   host   benchmarks/host_compiled.py --device cuda --breakdown --entries: host µs per attention call inside a
#          compiled block (cp_ops vs plain SDPA; W = 2, 4, 8; AGKV / Ulysses; no mask / every-key mask; cp_ops.compile vs
#          torch.compile) and each piece of the launch ops' host path alone, on the GPU machine's host (~2-3 min:
#          ~36 small compiles)
#   zimage cp-ops bound zimage --worlds 4 --compile-modes regional --cost --no-group1 --warmup 1 --repeats 3 --profile:
#          the rows with the host column (host ms, '*' = host-bound), TORCH_LOGS=recompiles (no recompile expected after
#          the first calls), one profiled forward per side (wall vs busy; Chrome traces) (~70 s: build ~20 s, 3 sides'
#          first calls 5-20 s each)
#   flux   the same for FLUX.1-dev, without the profile (~90 s)
# Expected if the rows are host-bound: cp_ops W4 'host ms' ~ its measured ms with '*', the plain side's host ms below
# 0.9 x its ms; host_compiled's cp_ops - plain µs per call, and the pieces that make it up, on this host.
set -u
: "${OUT:?OUT must name the output folder}"
T0=$SECONDS; END=${END:-540}; W=/tmp/gpu_host; mkdir -p "$W" "$OUT"; LOG=$W/log.txt
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export ROOT=$PWD; . benchmarks/gpu_site.sh
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)|MHz" | tee -a "$LOG"
save() { cp -r "$W"/. "$OUT"/; }
left() { echo $((END - (SECONDS - T0))); }
# step NAME CAP_S MIN_S -- COMMAND...
step() {
  local name=$1 cap=$2 min=$3; shift 4
  local l; l=$(left); local lim=$((cap < l ? cap : l))
  if [ "$lim" -lt "$min" ]; then echo "=== $name: skipped ($l s left, needs $min)" | tee -a "$LOG"; return; fi
  echo "=== $name (t=$((SECONDS - T0)) s, limit $lim s): $*" | tee -a "$LOG"
  timeout -s INT -k 10 "$lim" "$@" 2>&1 | grep -v "^USDT\|FutureWarning\|is deprecated\|experimental feature" \
    | tee -a "$LOG"
  echo "=== $name: rc=${PIPESTATUS[0]} at t=$((SECONDS - T0)) s" | tee -a "$LOG"
  save
}
step host 240 60 -- python3 benchmarks/host_compiled.py --device cuda --breakdown --entries --out "$W/host"
step zimage 150 60 -- env TORCH_LOGS=recompiles python3 -m cp_ops bound zimage --worlds 4 --compile-modes regional --cost \
  --no-group1 --warmup 1 --repeats 3 --profile "$W/prof" --out "$W/bound_zimage_regional_w4.json"
step flux 150 70 -- python3 -m cp_ops bound flux --worlds 4 --compile-modes regional --cost --no-group1 --warmup 1 \
  --repeats 3 --out "$W/bound_flux_regional_w4.json"
save
