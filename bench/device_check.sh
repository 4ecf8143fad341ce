#!/usr/bin/env bash
# One-shot GPU check for a lent device machine (no network there).
# Here, first: bash bench/device_check.sh --fetch   (downloads the wheels into .device/wheels)
# Then on the device, carrying ".device":  bash bench/device_check.sh   (about 8 minutes, most of it
# FlashInfer compiling its kernels; DEVICE_CHECK_BUDGET=seconds bounds the Python part, default 480)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device/wheels
if [ "${1:-}" = "--fetch" ]; then
  mkdir -p "$WHEELS"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" flashinfer-python==0.5.3 "apache-tvm-ffi<0.2" msgspec pyzmq \
    prometheus-client starlette anyio sniffio idna uvicorn h11 click  # (the last eight: --serve's server)
  du -sh "$WHEELS"
  exit 0
fi
# Into a folder of their own, next to the machine's torch (the wheels' other needs are there already);
# radixserve runs from this checkout.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-10}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout $(( ${DEVICE_CHECK_BUDGET:-480} + 60 )) python3 -m bench.device_check "$@"
