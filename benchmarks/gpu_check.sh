#!/usr/bin/env bash
# GPU check of fastbert's triton backend (see benchmarks/gpu_check.py), one phase per command, each well under
# 10 minutes on one H200:
#   bash benchmarks/gpu_check.sh --phase correctness      (kernels at real sizes, the kernel grid, models)
#   bash benchmarks/gpu_check.sh --phase timing [--autotune]
#   bash benchmarks/gpu_check.sh out.json --dry-run --phase all   (CPU, tiny sizes, Triton interpreter)
# Arguments: an optional first one not starting with "-" is the JSON path (as --out); every other argument goes
# to gpu_check.py as it is. Default JSON: $OUT/gpu_check-PHASE.json, else bench-results/gpu_check-PHASE.json
# (git-ignored). The real all-MiniLM-L6-v2 comes from bench-results/minilm-fp16 (benchmarks/make_minilm_fp16.py).
#
# fastbert is installed first, without the C++ extension, without dependencies and without an index
# (FASTBERT_SKIP_EXT=1 pip install --no-index --no-build-isolation --no-deps -e .); where that fails (no pip,
# an old setuptools), gpu_check.py imports fastbert from this checkout and maps kernels/ as fastbert.kernels.
# GPU_CHECK_INSTALL=0 skips the install. PYTHON picks the interpreter (default: .venv/bin/python if present, else
# python3). GPU_CHECK_TIMEOUT: the hard stop in seconds (default 570).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  command -v python3 >/dev/null 2>&1 || PYTHON=python
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
args=()
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  args+=(--out "$1")
  shift
fi
args+=("$@")
dry=0
for a in "$@"; do [ "$a" = --dry-run ] && dry=1; done

if [ "${GPU_CHECK_INSTALL:-1}" = 0 ]; then
  GPU_CHECK_INSTALL="skipped (GPU_CHECK_INSTALL=0)"
elif "$PYTHON" -c "import fastbert.kernels" >/dev/null 2>&1; then
  GPU_CHECK_INSTALL="already installed"
else
  log=$(mktemp "${TMPDIR:-/tmp}/gpu_check_pip.XXXXXX")
  if FASTBERT_SKIP_EXT=1 timeout 180 "$PYTHON" -m pip install -q --no-index --no-build-isolation --no-deps -e . \
      >"$log" 2>&1; then
    GPU_CHECK_INSTALL="pip install -e . (no ext, no deps, no index)"
  else
    GPU_CHECK_INSTALL="pip install failed, mapped by gpu_check.py: $(tail -c 300 "$log" | tr '\n' ' ')"
  fi
  rm -f "$log"
fi
export GPU_CHECK_INSTALL
echo "gpu_check.sh: python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'); fastbert: $GPU_CHECK_INSTALL"
[ "$dry" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
exec timeout "${GPU_CHECK_TIMEOUT:-570}" "$PYTHON" benchmarks/gpu_check.py "${args[@]}"
