#!/usr/bin/env bash
# call 2 of 2026-12-01c (issue 21): Flux/Qwen regional+graphs W4/W8 with the filled fake group; Wan2.1-14B 720p eager.
set -u
O=$OUT/c2; mkdir -p $O; T0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
st() { local name=$1 lim=$2; shift 2; echo "=== $name (t=$((SECONDS-T0)) s, limit $lim s): $*" | tee -a $O/log.txt
  timeout -s ABRT -k 5 $lim python3 -m cp_ops run "$@" --out $O/bound_$name.json 2>&1 | grep -v "^USDT" | tee -a $O/log.txt
  echo "=== $name: rc=${PIPESTATUS[0]} at t=$((SECONDS-T0)) s" | tee -a $O/log.txt; }
st flux_rg 110 flux --bound 4,8 --bound-compile regional+graphs --cost --no-group1 --profile $O/prof
L=$((200-SECONDS+T0)); [ $L -gt 60 ] && st qwen_rg $((L<90?L:90)) qwenimage --bound 4,8 --bound-compile regional+graphs --cost --no-group1
L=$((205-SECONDS+T0)); [ $L -gt 65 ] && st wan14b_720p $L wan --config 14b --frames 21 --height 90 --width 160 --bound 2,4,8 --bound-compile eager --no-group1 --warmup 0 --repeats 1
ls $O
