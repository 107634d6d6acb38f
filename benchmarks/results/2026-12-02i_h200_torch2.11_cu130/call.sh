#!/usr/bin/env bash
# 2026-12-02 (thirteenth session), calls on one H200 (issue 21). The steps live in benchmarks/gpu_steps.sh at the revision
# the log's `code:` line names (README.md says what each call ran and found).
# Run from the repository root: OUT=... STEPS="..." bash benchmarks/results/2026-12-02i_h200_torch2.11_cu130/call.sh
. benchmarks/gpu_steps.sh
