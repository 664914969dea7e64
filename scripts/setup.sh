#!/usr/bin/env bash
# Set up fastbert in ./.venv: PyTorch 2.13.0 (CPU build; pinned, since an open range pulls a multi-GB CUDA build),
# then fastbert itself (editable; builds the C++ extension fastbert._C) with the extras in EXTRAS (tests, benchmarks,
# embed, ray, serve).
# Idempotent: when .venv already holds all of that, current with this checkout, a second run only checks (a few
# seconds) and installs nothing; otherwise it says why and installs.
# Long steps print a line every HEARTBEAT_S seconds (default 15) with the time so far, and how long they took.
# Sourced (`source scripts/setup.sh`, as its tests do), it only defines its functions.
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
EXTRAS=dev,bench,embed,ray,serve
HEARTBEAT_S=${HEARTBEAT_S:-15}

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
  if ! with_heartbeat "$label" logged "$log" .venv/bin/python -m pip install --disable-pip-version-check "$@"; then
    grep -v "is ignored" "$log" >&2
    echo "fastbert setup: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}

# Prints why .venv needs the full install and fails, or what it found and succeeds. pip cannot be asked this:
# every `pip install -e .` rebuilds fastbert._C (30 s to minutes on 2 cores) even when nothing changed.
venv_is_current() {
  if [ ! -x .venv/bin/python ]; then
    echo "no .venv yet"
    return 1
  fi
  FASTBERT_ROOT=$PWD TORCH_VERSION=$TORCH_VERSION EXTRAS=$EXTRAS .venv/bin/python - <<'EOF'
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

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then  # sourced: the functions only
  return 0
fi
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SETUP_STARTED=$SECONDS
if reason=$(venv_is_current); then
  echo "fastbert setup: .venv is current, nothing to install: $reason" >&2
else
  echo "fastbert setup: installing: ${reason:-the check of .venv failed}" >&2
  if [ ! -x .venv/bin/python ]; then
    echo "fastbert setup: creating .venv" >&2
    "$PYTHON" -m venv .venv
  fi
  echo "fastbert setup: installing torch==$TORCH_VERSION and build tools" >&2
  pip_install "installing torch" "torch==$TORCH_VERSION" setuptools wheel ninja pybind11
  echo "fastbert setup: installing fastbert (editable, building fastbert._C: minutes on 2 cores) with its" \
    "$EXTRAS extras" >&2
  pip_install "installing fastbert and building fastbert._C" --no-build-isolation -e ".[$EXTRAS]"
fi
.venv/bin/python -W "ignore:fastbert:UserWarning" -c "import torch, fastbert; print(f'fastbert setup: torch {torch.__version__}; backends: ' \
+ fastbert.backends.describe_available())" >&2
echo "fastbert setup: done in $(elapsed_since "$SETUP_STARTED"). Commands are in .venv/bin: run 'source .venv/bin/activate' to use fastbert, pytest" \
  "and python bare, or call .venv/bin/fastbert etc." >&2
