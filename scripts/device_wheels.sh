#!/usr/bin/env bash
# Wheels the GPU machines of the device tool lack, for a machine with no network: the plugin's locked runtime closure
# (LOCK, which tests/deploy/runtime_lock.py keeps equal to the tested environment) less what their image already has
# (DEVICE_HAS: builds made for its CUDA and torch, which ours must not shadow; its grpcio, 1.84, is older than the
# generated code's floor, so ours goes). Taken from the lock, not listed here, so that a dependency the code gains is
# shipped without anyone remembering to add it (`No module named 'kubernetes'` was one).
# Downloaded here for CPython 3.12 into .whl/ (ignored by git, emptied first so a bumped pin leaves no second
# version), carried with `carry: [".whl"]`, and installed there with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# What then runs there: DEVICE_RUNS (`python -m MODULE`; gpuplugin.cli for scripts/validate_live.py).
# tests/deploy/test_device_wheels.py imports each, and every project module they import on the way, with only these
# wheels and DEVICE_HAS importable. `--list` prints the pins it would download and exits (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=deploy/requirements-plugin.txt
DEVICE_HAS=(torch torchvision nvidia-ml-py click numpy)
DEVICE_RUNS=(bench.sharing bench.mps_limits bench.mps_client bench.mps_daemonset bench.nccl bench.train gpuplugin.cli)

pins() {  # the lock's `name==version` lines, less the image's names
  grep -E '^[A-Za-z0-9]' "$LOCK" | grep -viE "^($(IFS='|'; echo "${DEVICE_HAS[*]}"))==" || true
}

if [[ "${1:-}" == "--list" ]]; then
  pins
  exit 0
fi
mapfile -t PINS < <(pins)
(( ${#PINS[@]} )) || { echo "no pins in $LOCK" >&2; exit 1; }
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PINS[@]}"
ls .whl
echo "runs there: ${DEVICE_RUNS[*]}"
