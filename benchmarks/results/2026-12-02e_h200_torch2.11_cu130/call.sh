#!/usr/bin/env bash
# 2026-12-02 (ninth session), calls on one H200 (issue 21). The steps live in benchmarks/gpu_steps.sh at the revision
# the log's `code:` line names. Call 1: STEPS="t2r tests fp8f tcpu flux_unev" END=540; call 2: STEPS="tcpu tests
# cmp_flux" END=530; call 3: STEPS="flux_full" END=570 FCAP=570 (README.md says what each found).
# Run from the repository root: OUT=... STEPS="..." bash benchmarks/results/2026-12-02e_h200_torch2.11_cu130/call.sh
. benchmarks/gpu_steps.sh
