"""End-to-end benchmark from a checkout, without installing the console script: the same as ``fastbert bench``.

    .venv/bin/python benchmarks/e2e.py                 # defaults: the embedded MiniLM, best device, 1 and 8 x 128
    .venv/bin/python benchmarks/e2e.py --quick --out /tmp/e2e
    .venv/bin/python benchmarks/e2e.py --batch 1 8 --seq 128 --peers hf-eager hf-sdpa compile onnxruntime
    .venv/bin/python benchmarks/e2e.py --peers fastbert-static --threads 1   # auto measured vs its static order

Every option of ``fastbert bench --help`` applies; the logic lives in `fastbert.bench` (importable by the
installed CLI). Results go to a new folder bench-results/<machine-tag>-e2e-<YYYYmmdd-HHMMSS>/ under the current
directory unless --out names one; the committed benchmarks/results/ change only when --out names them.
"""

import sys

from fastbert.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
