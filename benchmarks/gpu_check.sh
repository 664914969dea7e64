#!/usr/bin/env bash
# GPU check of fastbert's triton backend (see benchmarks/gpu_check.py): <= 8 minutes on one H200.
# Usage: bash benchmarks/gpu_check.sh [JSON_PATH]     (default: $OUT/gpu_check.json, or ./gpu_check.json)
#        bash benchmarks/gpu_check.sh --dry-run       (CPU, tiny sizes, Triton interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
args=()
case "${1:-}" in
  --dry-run) args+=(--dry-run) ;;
  "") ;;
  *) args+=(--out "$1") ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
# fastbert.kernels maps to kernels/ only when installed; gpu_check.py maps it itself when it is not.
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "${args[@]}"
