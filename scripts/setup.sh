#!/usr/bin/env bash
# Set up fastbert in ./.venv: PyTorch 2.13.0 (CPU build; pinned, since an open range pulls a multi-GB CUDA build),
# then fastbert itself (editable; builds the C++ extension fastbert._C) with its test and benchmark extras.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "fastbert setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" setuptools wheel ninja pybind11 2>&1 \
  | grep -v "is ignored" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[dev,bench]" 2>&1 \
  | grep -v "is ignored" || true
.venv/bin/python -c "import torch, fastbert; print(f'fastbert setup: torch {torch.__version__}, backends', fastbert.backends.available())" >&2
