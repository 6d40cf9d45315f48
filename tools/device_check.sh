#!/usr/bin/env bash
# The prepared device check: what a session lent a GPU runs first, as one command through the
# device tool (`run`, command `bash tools/device_check.sh`, timeout_s 540). It needs the
# machine's own python3 with a CUDA torch (no install step: nothing can be fetched there).
#   1. the CUDA tests (tests/engine/test_cuda.py; those needing 2 GPUs skip on one), 4 min cap;
#   2. `fullshard bench --device cuda`, bf16, both doors against local, torch FSDP1 and FSDP2,
#      on the comm config (101M parameters) at world size 1, 4 min cap;
# and writes under $OUT (the device tool brings it back): env.txt, cuda_tests.log, bench.log,
# bench-cuda-bf16.json. Each step runs whatever the one before gave; the exit status is the
# worst of them. A dry run on a CPU machine: CHECK_DEVICE=cpu OUT=/tmp/check bash tools/device_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/device_check}
DEVICE=${CHECK_DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

"$PYTHON" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.device_count(), "GPU(s)")
PY

timeout 240 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/engine/test_cuda.py \
    2>&1 | tee "$OUT/cuda_tests.log" || status=1

config=comm
[ "$DEVICE" = cpu ] && config=tiny
timeout 240 "$PYTHON" -m fullshard bench --device "$DEVICE" --config "$config" --world-size 1 \
    --mixed-precision bf16 --engines local,fsdp1,fsdp2,fullshard,fullshard-fsdp2 \
    --rounds 2 --steps 5 --warmup 2 --json "$OUT/bench-$DEVICE-bf16.json" \
    2>&1 | tee "$OUT/bench.log" || status=1

exit "$status"
