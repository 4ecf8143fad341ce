#!/usr/bin/env bash
# One-shot GPU check for a lent device machine (no network there).
# Here, first: bash bench/device_check.sh --fetch   (downloads the wheels into .device/wheels)
# Then run on the device with carry [".device"]:  bash bench/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device/wheels
if [ "${1:-}" = "--fetch" ]; then
  mkdir -p "$WHEELS"
  pip download --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" \
    flashinfer-python==0.5.3 apache-tvm-ffi msgspec pyzmq
  du -sh "$WHEELS"
  exit 0
fi
pip install --no-index --find-links "$WHEELS" --no-deps flashinfer-python apache-tvm-ffi msgspec pyzmq >/dev/null
pip install --no-deps -e . >/dev/null
timeout 540 python -m bench.device_check
