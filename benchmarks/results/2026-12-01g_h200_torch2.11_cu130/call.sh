#!/usr/bin/env bash
# 2026-12-01g (issue 21), one H200, ONE call: the gloo-CUDA two-rank tests, then the bound rows still missing —
# --steps loops at full size, diffusers' own CP beside cp_ops (--compare diffusers), the `regional` compile mode with
# --cost, and one whole-forward (`full+graphs`) case. Each step = one process under `timeout` (cap, and never past END
# seconds from the start; a step with less than its minimum left is skipped); cp-ops writes its --out JSON after every
# compile mode, and after each step everything so far is packed into $OUT (results.tgz, log.txt), so a step killed at
# its limit keeps the earlier ones. Order: cheap and most wanted first, the riskiest (whole-forward compile) last.
# Run from the repository root: OUT=... bash benchmarks/results/2026-12-01g_h200_torch2.11_cu130/call.sh
# Ran at cd49827 (with the gloo-CUDA gather fix, gloo_cuda_gather.patch); tests_before needs
# $HERE/torch_transport_before.py = cp_ops/transport/torch.py before the fix (`git show cd49827:$HERE/...`; removed
# afterwards with the fix itself, so the step now finds no file).
# Estimates (from 2026-12-01/c/e log_call*.txt: model build + import ~20 s per process; regional compile of one side
# 5-10 s (diffusers' 13-20 s); eager image forwards 0.1-0.2 s): tests 40 s, zimage_steps 75 s, wan_steps 60 s,
# flux_rc 200 s, zimage_r 70 s, ltx_r 55 s, ltx_full unknown (whole-forward compile, ~30 s a side?).
set -u
: "${OUT:?OUT must name the output folder}"
T0=$SECONDS; END=${END:-575}; W=/tmp/w; mkdir -p "$W"; LOG=$OUT/log.txt
HERE=benchmarks/results/2026-12-01g_h200_torch2.11_cu130
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export ROOT=$PWD; . benchmarks/gpu_site.sh
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'diffusers', diffusers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,memory.used --format=csv 2>&1 | tee -a "$LOG"
pack() { tar czf "$OUT/results.tgz.part" -C "$W" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
left() { echo $((END - (SECONDS - T0))); }
# st NAME CAP_S MIN_S -- MODEL ARGS...
st() {
  local name=$1 cap=$2 min=$3; shift 4
  local l; l=$(left); local lim=$((cap < l ? cap : l))
  if [ "$lim" -lt "$min" ]; then echo "=== $name: skipped (t=$((SECONDS - T0)) s: $l s left, needs $min)" | tee -a "$LOG"; return; fi
  echo "=== $name (t=$((SECONDS - T0)) s, limit $lim s): cp-ops run $*" | tee -a "$LOG"
  timeout -s ABRT -k 5 "$lim" python3 -m cp_ops run "$@" --out "$W/bound_$name.json" 2>&1 \
    | grep -v "^USDT\|FutureWarning\|all_gather_tensor. is deprecated\|experimental feature" | tee -a "$LOG"
  echo "=== $name: rc=${PIPESTATUS[0]} at t=$((SECONDS - T0)) s" | tee -a "$LOG"
  pack
}
tests() {  # tests NAME CAP MIN: the two-rank gloo-CUDA tests (one GPU shared by 2 ranks)
  local name=$1 cap=$2 min=$3; local l; l=$(left); local lim=$((cap < l ? cap : l))
  if [ "$lim" -lt "$min" ]; then echo "=== $name: skipped ($l s left)" | tee -a "$LOG"; return; fi
  echo "=== $name (t=$((SECONDS - T0)) s, limit $lim s)" | tee -a "$LOG"
  timeout -k 5 "$lim" python3 -m pytest -q -rs -p no:cacheprovider -n 0 -m gpu tests/test_one_gpu.py tests/test_fp8.py \
    -k two_ranks 2>&1 | tail -40 | tee -a "$LOG" "$W/$name.txt"
  echo "=== $name: rc=${PIPESTATUS[0]} at t=$((SECONDS - T0)) s" | tee -a "$LOG"
  pack
}
NG="--no-group1"
STEPS=${STEPS:-tests zimage_steps wan_steps flux_rc zimage_r ltx_r ltx_full tests_before}
for s in $STEPS; do case $s in
  # 1. the fix in cp_ops/transport/torch.py (gloo + CUDA: list-form all-gathers, no send/recv)
  tests)        tests tests 90 30 ;;
  # 2. --steps at full size: Z-Image-Turbo's 8 steps (regional+graphs, then eager); Wan2.1-1.3B 5 of its 50 (eager)
  #    with diffusers' CP beside (its rows are loops too)
  zimage_steps) st zimage_steps 110 60 -- zimage --bound 2,4,8 --steps 8 --bound-compile regional+graphs,eager $NG --warmup 1 --repeats 3 ;;
  wan_steps)    st wan_steps 100 50 -- wan --config 1.3b --bound 2,4,8 --steps 5 --bound-compile eager --compare diffusers $NG --warmup 0 --repeats 2 ;;
  # 3. FLUX.1-dev: diffusers' CP (Ulysses, ring) beside cp_ops, eager and regional; regional with cp_ops' cost
  flux_rc)      st flux_rc 230 90 -- flux --bound 2,4,8 --bound-compile eager,regional --cost --compare diffusers $NG --warmup 1 --repeats 3 ;;
  # 4. the `regional` (no graphs) mode with --cost
  zimage_r)     st zimage_r 90 50 -- zimage --bound 2,4,8 --bound-compile regional --cost $NG --warmup 1 --repeats 3 ;;
  ltx_r)        st ltx_r 80 45 -- ltx --bound 2,4,8 --bound-compile regional --cost $NG --warmup 1 --repeats 3 ;;
  # 5. whole forward, fullgraph, CUDA graphs (riskiest: one compile of the whole model per side). LTX-Video: the
  #    smallest; Z-Image-Turbo's forward enters `with torch.device(...)`, which Dynamo refuses (fullgraph fails in
  #    diffusers itself: seen on CPU, torch 2.13)
  ltx_full)     st ltx_full 170 100 -- ltx --bound 2,4,8 --bound-compile full+graphs $NG --warmup 1 --repeats 3 ;;
  # 6. the same two-rank tests on the code before the fix (was the launcher change of 2026-12-01f enough alone?)
  tests_before) cp cp_ops/transport/torch.py /tmp/torch_transport_fixed.py; cp $HERE/torch_transport_before.py cp_ops/transport/torch.py
                tests tests_before 60 25
                cp /tmp/torch_transport_fixed.py cp_ops/transport/torch.py ;;
  *) echo "=== unknown step $s" | tee -a "$LOG" ;;
esac; done
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
pack; ls -la "$OUT" | tee -a "$LOG"
