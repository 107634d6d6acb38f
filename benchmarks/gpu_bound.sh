#!/usr/bin/env bash
# Issue 21's zero-communication bound of the full-size DiTs on ONE GPU, one call:
#   benchmarks/gpu_bound.sh OUT_DIR [step ...]
# Each step is `MODEL[:CONFIG]@MODES` (MODES: comma-separated --compile-modes modes), run as
#   cp-ops bound MODEL --config CONFIG --worlds $BOUND_W --compile-modes MODES --cost [--profile] --out OUT/bound_<name>.json
# at the model's standard resolution (the CUDA defaults of cp-ops run), every step under STEP_TIMEOUT seconds.
# Env: BOUND_W (default 2,4,8), STEP_TIMEOUT (default 300), BOUND_ARGS (extra arguments for every step),
#      PROFILE_RE (steps whose name matches get --profile OUT/prof), DEADLINE (seconds after which no new step starts).
# Wheels in .whl/ (diffusers and its importlib_metadata) are installed into /tmp/site first when present, unless the
# script that started this one did it (benchmarks/gpu_site.sh).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_bound.sh OUT_DIR [step ...]}; shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
. "$ROOT/benchmarks/gpu_site.sh"  # the wheels into /tmp/site, once (a caller that did it is not repeated)
mkdir -p "$OUT"
LOG=$OUT/log.txt
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
T0=$SECONDS
status=0
for st in "$@"; do
  if [ -n "${DEADLINE:-}" ] && [ $((SECONDS - T0)) -ge "$DEADLINE" ]; then echo "=== $st: skipped (DEADLINE ${DEADLINE} s)" | tee -a "$LOG"; continue; fi
  spec=${st%@*}; modes=${st#*@}; model=${spec%:*}; cfg=""; [ "$spec" != "$model" ] && cfg=${spec#*:}
  name=${model}${cfg:+_$cfg}_${modes//[,+]/_}
  prof=""; [[ $st =~ ${PROFILE_RE:-^$} ]] && prof="--profile $OUT/prof"
  echo "=== $name: cp-ops bound $model ${cfg:+--config $cfg} --worlds ${BOUND_W:-2,4,8} --compile-modes $modes --cost $prof ${BOUND_ARGS:-}" | tee -a "$LOG"
  t=$SECONDS
  timeout -k 10 "${STEP_TIMEOUT:-300}" python3 -m cp_ops bound "$model" ${cfg:+--config $cfg} --worlds "${BOUND_W:-2,4,8}" \
    --compile-modes "$modes" --cost $prof ${BOUND_ARGS:-} --out "$OUT/bound_$name.json" 2>&1 | grep -v "^USDT" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1
  echo "=== $name: rc=$rc in $((SECONDS - t)) s" | tee -a "$LOG"
done
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
exit $status
