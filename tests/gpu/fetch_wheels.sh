#!/usr/bin/env bash
# Wheels for tests/gpu/*_check.py on a GPU machine without network (Python 3.12, CUDA torch already there):
# megatron-core and pydantic (with its compiled core), the versions pinned in constraints/cpu.txt.
# Run here, from the repository root: bash tests/gpu/fetch_wheels.sh   -> .whl/*.whl (.gitignore)
# then carry ".whl" and install there with pip --no-index --target (see tests/gpu/calibration_device_check.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
for spec in megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls -l .whl
