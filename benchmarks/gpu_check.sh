#!/usr/bin/env bash
# GPU check of fastbert (see benchmarks/gpu_check.py), one phase per command, each at most 6 minutes on one H200
# (section limits: correctness 270 s, timing 320 s, more 255 s; imports and setup come on top; the hard stop is
# GPU_CHECK_TIMEOUT, default 360 s; 1800 s for a dry run). JSON is rewritten after every check, so a stopped phase
# keeps what it did.
#
# The run, in this order (each its own device command; carry bench-results/minilm-fp16 for the real-model check,
# made on any machine by `.venv/bin/python benchmarks/make_minilm_fp16.py`):
#   1. bash benchmarks/gpu_check.sh --phase correctness   every kernel at real sizes, the kernel grid, the candidate
#                                                          backends (triton, vendor), cached vs plain launches, models
#   2. bash benchmarks/gpu_check.sh --phase timing        host µs per launch (bare kernel[grid], cached launcher,
#                                                          fastbert's op), the GEMM table, BERT-base end to end vs HF
#                                                          eager / SDPA / torch.compile default and max-autotune, and
#                                                          what the dispatcher chose
#   3. bash benchmarks/gpu_check.sh --phase more          (optional) ModernBERT, corpus embedding, training steps
# Options: --autotune (timing: autotune the GEMMs instead of the fixed table), --limit SECTION=SECONDS,
# --minilm DIR, --pytest (correctness: also pytest tests/ops where pytest is installed).
# Dry run on a CPU machine (tiny sizes, Triton interpreter; every section must run to its end and write its JSON):
#   bash benchmarks/gpu_check.sh out.json --dry-run --phase correctness    (likewise timing, more; or all)
#   bash benchmarks/rehearse_gpu_stack.sh    (the same under the GPU machine's triton 3.6 / transformers 5.17)
# Arguments: an optional first one not starting with "-" is the JSON path (as --out); every other argument goes
# to gpu_check.py as it is. Default JSON: $OUT/gpu_check-PHASE.json, else bench-results/gpu_check-PHASE.json
# (git-ignored).
#
# fastbert is installed first, without the C++ extension, without dependencies and without an index
# (FASTBERT_SKIP_EXT=1 pip install --no-index --no-build-isolation --no-deps -e .); where that fails (no pip,
# an old setuptools), gpu_check.py imports fastbert from this checkout and maps kernels/ as fastbert.kernels.
# GPU_CHECK_INSTALL=0 skips the install. PYTHON picks the interpreter (default: .venv/bin/python if present, else
# python3). FASTBERT_CACHED_LAUNCH=0 launches every kernel through triton's own path (the cached launcher off).
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
stop=360
[ "$dry" = 1 ] && stop=1800  # the interpreter on a shared CPU machine: minutes per phase
exec timeout "${GPU_CHECK_TIMEOUT:-$stop}" "$PYTHON" benchmarks/gpu_check.py "${args[@]}"
