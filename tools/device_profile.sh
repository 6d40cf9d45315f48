#!/usr/bin/env bash
# Where each engine's step goes on one GPU (tools/step_profile.py), as one device-tool command:
# `bash tools/device_profile.sh` (timeout_s 400). Writes $OUT/profile.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/device_profile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
P="timeout 150 ${PYTHON:-python3} tools/step_profile.py --device ${CHECK_DEVICE:-cuda} --config ${CONFIG:-comm} --mixed-precision bf16 --steps 10"
{
  $P --engines local,fsdp1,fsdp2,fullshard,fullshard-fsdp2 --sync-debug
  $P --engines fullshard-fsdp2,fsdp2,fullshard --foreach off
  $P --engines fullshard-fsdp2,fsdp2 --profile 35
} 2>&1 | grep -v -E "Warning|warn\(|return func|_init_core_state|unit = build|FullyShardedDataParallel\(" | tee "$OUT/profile.log"
