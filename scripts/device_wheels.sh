#!/usr/bin/env bash
# Wheels the GPU machines of the device tool lack (their image has torch, NCCL, nvidia-ml-py, click, numpy, grpcio
# 1.84): downloaded here for CPython 3.12 into .whl/ (ignored by git), carried with `carry: [".whl"]`, and installed
# there with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for pkg in structlog==26.1.0 watchdog==7.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
           typing-inspection==0.4.5 typing-extensions==4.16.0 tenacity==9.2.1 orjson==3.13.0 grpcio==1.85.1 \
           protobuf==7.36.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pkg"
done
ls .whl
