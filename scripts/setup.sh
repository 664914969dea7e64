#!/usr/bin/env bash
# Set up fastbert in ./.venv: PyTorch 2.13.0 (CPU build; pinned, since an open range pulls a multi-GB CUDA build),
# then fastbert itself (editable; builds the C++ extension fastbert._C) with the extras in EXTRAS (tests, benchmarks,
# embed, ray, serve), every package at the version in constraints.txt: the stack the test suite last passed with.
#
#   ./scripts/setup.sh                   the tested stack (constraints.txt) in .venv
#   VENV=.venv-newest ./scripts/setup.sh --newest
#                                        the newest releases instead (torch still TORCH_VERSION), in VENV: what a
#                                        user installing fastbert today gets (.ci/run runs the default tests on it)
#   ./scripts/setup.sh --freeze          write constraints.txt from .venv (after the suite passed on it)
#
# Idempotent: when the venv already holds all of that, current with this checkout, a second run only checks (a few
# seconds) and installs nothing; otherwise it says why and installs. --newest always installs (upgrading).
# Long steps print a line every HEARTBEAT_S seconds (default 15) with the time so far, and how long they took.
# Sourced (`source scripts/setup.sh`, as its tests do), it only defines its functions.
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
EXTRAS=dev,bench,embed,ray,serve
HEARTBEAT_S=${HEARTBEAT_S:-15}
CONSTRAINTS=constraints.txt

elapsed_since() {  # "4m07s" since the bash time $1 (SECONDS)
  local s=$((SECONDS - $1))
  printf '%dm%02ds' $((s / 60)) $((s % 60))
}

# Runs "${@:2}" with a line every HEARTBEAT_S seconds while it runs, then one with how long it took; returns its
# exit status. pip prints nothing for minutes while it compiles fastbert._C, which reads as a hang.
with_heartbeat() {
  local label=$1 started=$SECONDS pid status=0
  shift
  "$@" &
  pid=$!
  local next=$((SECONDS + HEARTBEAT_S))
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.2
    if ((SECONDS >= next)) && kill -0 "$pid" 2>/dev/null; then
      echo "fastbert setup: still $label ($(elapsed_since "$started") elapsed)" >&2
      next=$((next + HEARTBEAT_S))
    fi
  done
  wait "$pid" || status=$?
  echo "fastbert setup: $label took $(elapsed_since "$started")" >&2
  return "$status"
}

logged() {  # logged LOG CMD...: CMD's output into LOG
  local log=$1
  shift
  "$@" >"$log" 2>&1
}

pip_install() {  # pip_install LABEL ARGS...: a heartbeat while it runs, else quiet on success; the log on failure
  local label=$1 log
  shift
  log=$(mktemp)
  if ! with_heartbeat "$label" logged "$log" "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"; then
    grep -v "is ignored" "$log" >&2
    echo "fastbert setup: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}

# Prints why the venv needs the full install and fails, or what it found and succeeds. pip cannot be asked this:
# every `pip install -e .` rebuilds fastbert._C (30 s to minutes on 2 cores) even when nothing changed.
venv_is_current() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "no $VENV yet"
    return 1
  fi
  FASTBERT_ROOT=$PWD TORCH_VERSION=$TORCH_VERSION EXTRAS=$EXTRAS CONSTRAINTS=$CONSTRAINTS "$VENV/bin/python" - <<'EOF'
import json
import os
import sys
import sysconfig
from importlib import metadata
from urllib.parse import unquote, urlparse

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement


def stale(why):
    print(why)
    sys.exit(1)


def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


root = os.environ["FASTBERT_ROOT"]
extras = os.environ["EXTRAS"].split(",")
# Only the installed metadata counts: a fastbert.egg-info left in the checkout by a wheel or sdist build would
# otherwise be found first through the current directory on sys.path.
sys.path[:] = [path for path in sys.path if os.path.realpath(path or ".") != os.path.realpath(root)]
torch = version("torch")
if torch is None or not Requirement(f"torch=={os.environ['TORCH_VERSION']}").specifier.contains(torch):
    stale(f"torch is {torch or 'not installed'}, want {os.environ['TORCH_VERSION']}")  # a +cpu build matches
try:
    dist = metadata.distribution("fastbert")
except metadata.PackageNotFoundError:
    stale("fastbert is not installed")
origin = json.loads(dist.read_text("direct_url.json") or "{}")
origin_dir = unquote(urlparse(origin.get("url", "")).path)
if not origin.get("dir_info", {}).get("editable") or os.path.realpath(origin_dir) != os.path.realpath(root):
    stale("fastbert is not installed in editable mode from this checkout")
if not os.path.exists(os.path.join(sys.prefix, "bin", "fastbert")):
    stale("the fastbert command is missing")
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker is not None and not any(req.marker.evaluate({"extra": extra}) for extra in ["", *extras]):
        continue
    have = version(req.name)
    if have is None or not req.specifier.contains(have, prereleases=True):
        stale(f"requirement {req.name}{req.specifier} not met ({'have ' + have if have else 'not installed'})")
with open(os.path.join(root, os.environ["CONSTRAINTS"])) as pins:
    for line in pins:
        req = Requirement(line.split("#")[0].strip()) if line.split("#")[0].strip() else None
        have = version(req.name) if req is not None else None
        if have is not None and not req.specifier.contains(have, prereleases=True):
            stale(f"{req.name} {have} is not the tested {req.specifier} of {os.environ['CONSTRAINTS']}")


def mtime(path):
    return os.stat(os.path.join(root, path)).st_mtime_ns


build_inputs = ["setup.py", "pyproject.toml"]
installed = dist.locate_file(f"fastbert-{dist.version}.dist-info/METADATA")
if not os.path.exists(installed):
    stale(f"{installed} is missing")
for path in build_inputs:
    if mtime(path) > os.stat(installed).st_mtime_ns:
        stale(f"{path} changed since fastbert was installed")
if os.environ.get("FASTBERT_SKIP_EXT", "0").lower() in ("1", "true", "yes"):
    extension = "fastbert._C not required (FASTBERT_SKIP_EXT=1)"
else:
    if os.environ.get("FASTBERT_CPU_CAPABILITY"):
        stale("FASTBERT_CPU_CAPABILITY is set: building fastbert._C for it")
    extension = "fastbert/_C" + sysconfig.get_config_var("EXT_SUFFIX")
    if not os.path.exists(os.path.join(root, extension)):
        stale(f"{extension} is not built (FASTBERT_SKIP_EXT=1 skips it)")
    sources = sorted(os.path.join("csrc", name) for name in os.listdir(os.path.join(root, "csrc")))
    newer = [path for path in sources + build_inputs if mtime(path) > mtime(extension)]
    if newer:
        stale(f"{', '.join(newer)} changed since {extension} was built")
    extension += " newer than csrc/, setup.py and pyproject.toml"
print(f"torch {torch}; fastbert editable from this checkout with {','.join(extras)} met; {extension}")
EOF
}

# Writes constraints.txt: every package in the venv but fastbert, at its version (torch without its +cpu label).
freeze_constraints() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "fastbert setup: no $VENV to freeze; run ./scripts/setup.sh first" >&2
    return 1
  fi
  {
    echo "# The stack the test suite last passed with, written by scripts/setup.sh --freeze from $VENV on $(date -u +%F)"
    echo "# (Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')). setup.sh installs these versions; --newest ignores them."
    "$VENV/bin/python" -m pip freeze --disable-pip-version-check --exclude-editable | sed -E 's/^(torch==[^+]*)\+.*/\1/'
  } >"$CONSTRAINTS.new"
  mv "$CONSTRAINTS.new" "$CONSTRAINTS"
  echo "fastbert setup: wrote $CONSTRAINTS ($(grep -vc '^#' "$CONSTRAINTS") packages)" >&2
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then  # sourced: the functions only
  return 0
fi
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode=tested
case "${1:-}" in
  "") ;;
  --newest) mode=newest ;;
  --freeze) freeze_constraints; exit 0 ;;
  *) echo "fastbert setup: unknown option ${1}; use --newest, --freeze or nothing" >&2; exit 2 ;;
esac
SETUP_STARTED=$SECONDS
if [ "$mode" = tested ] && reason=$(venv_is_current); then
  echo "fastbert setup: $VENV is current, nothing to install: $reason" >&2
else
  if [ "$mode" = newest ]; then
    reason="--newest: the newest releases, whatever $CONSTRAINTS says"
    pins=$(mktemp)
    trap 'rm -f "$pins"' EXIT
    echo "torch==$TORCH_VERSION" >"$pins"  # an open torch pulls a multi-GB CUDA build
    upgrade=(--upgrade --upgrade-strategy eager)
  else
    pins=$CONSTRAINTS
    upgrade=()  # (expanded as ${upgrade[@]+...}: bash before 4.4 calls an empty array unbound under set -u)
  fi
  echo "fastbert setup: installing: ${reason:-the check of $VENV failed}" >&2
  if [ ! -x "$VENV/bin/python" ]; then
    echo "fastbert setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
  fi
  echo "fastbert setup: installing torch==$TORCH_VERSION and build tools" >&2
  pip_install "installing torch" -c "$pins" ${upgrade[@]+"${upgrade[@]}"} "torch==$TORCH_VERSION" setuptools wheel ninja pybind11
  echo "fastbert setup: installing fastbert (editable, building fastbert._C: minutes on 2 cores) with its" \
    "$EXTRAS extras ($mode versions)" >&2
  pip_install "installing fastbert and building fastbert._C" -c "$pins" ${upgrade[@]+"${upgrade[@]}"} --no-build-isolation \
    -e ".[$EXTRAS]"
fi
"$VENV/bin/python" -W "ignore:fastbert:UserWarning" -c "import torch, transformers, fastbert; print(f'fastbert setup: torch \
{torch.__version__}, transformers {transformers.__version__}; backends: ' + fastbert.backends.describe_available())" >&2
echo "fastbert setup: done in $(elapsed_since "$SETUP_STARTED"). Commands are in $VENV/bin: run 'source $VENV/bin/activate' to use fastbert," \
  "pytest and python bare, or call $VENV/bin/fastbert etc." >&2
