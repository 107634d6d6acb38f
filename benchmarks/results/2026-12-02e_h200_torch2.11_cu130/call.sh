#!/usr/bin/env bash
# 2026-12-02 (ninth session), calls on one H200 (issue 21). The steps live in benchmarks/gpu_steps.sh at the revision
# the log's `code:` line names. Call 1: STEPS="t2r tests fp8f tcpu flux_unev cmp_flux" (the GPU tests of the prefix
# split and the FP8 decode's sign fix, the side-effect fix under torch 2.11, FLUX.1-dev 1008² re-measured, diffusers'
# own CP beside cp_ops); later calls: whole-model compile rows (STEPS and FW named in the README).
# Run from the repository root: OUT=... STEPS="..." bash benchmarks/results/2026-12-02e_h200_torch2.11_cu130/call.sh
. benchmarks/gpu_steps.sh
