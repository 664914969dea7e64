#!/usr/bin/env bash
# Set up fastbert in ./.venv: PyTorch 2.13.0 (CPU build; pinned, since an open range pulls a multi-GB CUDA build),
# then fastbert itself (editable; builds the C++ extension fastbert._C) with its test and benchmark extras.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

pip_install() {  # quiet on success, the whole log on failure
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2
    echo "fastbert setup: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}

if [ ! -x .venv/bin/python ]; then
  echo "fastbert setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
echo "fastbert setup: installing torch==2.13.0 and build tools" >&2
pip_install "torch==2.13.0" setuptools wheel ninja pybind11
echo "fastbert setup: installing fastbert (editable, building fastbert._C) with its dev and bench extras" >&2
pip_install --no-build-isolation -e ".[dev,bench]"
.venv/bin/python -c "import torch, fastbert; print(f'fastbert setup: torch {torch.__version__}; backends', \
fastbert.backends.available())" >&2
