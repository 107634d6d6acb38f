#!/usr/bin/env bash
# FP8 communication on ONE GPU (issue 24), in one call on the GPU machine (1x H200), within DEADLINE (285) s:
#   benchmarks/gpu_fp8.sh OUT_DIR [STEPS]     STEPS: comma-separated, default selftest,micro,flux,zimage,wan,tests
#   selftest — the Triton codec against the torch version (cp_ops.kernels.fp8.self_test);
#   codec    — benchmarks/fp8.py codec: where the Triton and torch encoders differ (payload / scale bytes);
#   micro    — benchmarks/fp8.py kernels,micro: the codec's µs vs the link time its bytes save; per-tensor-choice error;
#   kernels  — benchmarks/fp8.py kernels alone;
#   flux, zimage, wan — benchmarks/fp8.py models: full-size models emulated (CP_OPS_EMULATE_COMM), one process each;
#   vae      — benchmarks/fp8.py vae: full-size Flux, 8 steps, decoded through a full-size VAE: pixel PSNR per variant;
#   tests    — the gpu-marked tests of tests/test_fp8.py: the Triton kernels bitwise against the torch version; two
#              ranks sharing the GPU.
#   gtests   — the gpu-marked tests of tests/test_fp8.py but the two-ranks one; tworanks — that one alone;
#   fused    — the FP8 codec fused with the Ulysses pack/unpack (cp_ops/kernels/fp8_ulysses.py): its gpu-marked tests
#              (bitwise against the references and the unfused path; the self-test of the contiguous kernels), then
#              benchmarks/fp8.py --sections fused (µs and GB/s fused vs unfused vs the contiguous encode, the first
#              call's seconds, the compiled variants; a table on stdout), each with a fresh Triton cache (~60-90 s);
#   qwen, ltx, hunyuan, wan14b — the remaining full-size models emulated, one process each (2026-12-01g: steps and
#              variants chosen to fit the device budget: MODEL_ARGS_<name> overrides them).
# Wheels in .whl/ (diffusers, ...) go to /tmp/site first (benchmarks/gpu_site.sh).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_fp8.sh OUT_DIR [STEPS]}
STEPS=,${2:-selftest,micro,flux,zimage,wan,tests},
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
. benchmarks/gpu_site.sh
mkdir -p "$OUT"
LOG=$OUT/log.txt
END=$((SECONDS + ${DEADLINE:-285}))
status=0
step() { local name=$1 limit=$2; shift 2; case $STEPS in *",$name,"*) ;; *) return ;; esac
  local left=$((END - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "=== $name: skipped (deadline)" | tee -a "$LOG"; status=1; return; fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"; local t=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | grep -v "^USDT" | tee -a "$LOG"; local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t)) s" | tee -a "$LOG"; [ "$rc" = 0 ] || status=1; }
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'diffusers', diffusers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
step selftest 30 python3 -c "import torch; from cp_ops.kernels import fp8; print('triton codec self-test:', fp8.self_test(torch.device('cuda')) or 'bitwise equal to torch')"
step codec 30 python3 benchmarks/fp8.py --out "$OUT" --sections codec
step micro 40 python3 benchmarks/fp8.py --out "$OUT" --sections kernels,micro
step kernels 30 python3 benchmarks/fp8.py --out "$OUT" --sections kernels
step flux 55 python3 benchmarks/fp8.py --out "$OUT/flux" --sections models --models flux --steps 8
step zimage 50 python3 benchmarks/fp8.py --out "$OUT/zimage" --sections models --models zimage --steps 8
step wan 70 python3 benchmarks/fp8.py --out "$OUT/wan" --sections models --models wan --steps 4
step tests 150 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_fp8.py
step vae 120 python3 benchmarks/fp8.py --out "$OUT/vae" --sections vae --models flux --steps 8
step gtests 90 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_fp8.py -k "not two_ranks"
step fused 90 bash -c 'TRITON_CACHE_DIR=$(mktemp -d) python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/test_fp8.py -k "fused or nonfinite" && TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/fp8.py --out "$0" \
  --sections fused' "$OUT"
step ltx 30 python3 benchmarks/fp8.py --out "$OUT/ltx" --sections models --models ltx ${MODEL_ARGS_ltx:---steps 8}
step qwen 50 python3 benchmarks/fp8.py --out "$OUT/qwen" --sections models --models qwenimage ${MODEL_ARGS_qwen:---steps 4 --variants agkv,e4m3,cachedit,e5m2}
step hunyuan 80 python3 benchmarks/fp8.py --out "$OUT/hunyuan" --sections models --models hunyuanvideo ${MODEL_ARGS_hunyuan:---steps 2 --no-bf16-check --variants agkv,e4m3,e5m2,cachedit}
step wan14b 90 python3 benchmarks/fp8.py --out "$OUT/wan14b" --sections models --models wan:14b ${MODEL_ARGS_wan14b:---steps 2 --no-bf16-check --variants agkv,e4m3,e5m2,cachedit}
step tworanks 45 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_fp8.py -k two_ranks
exit $status
