"""Forward cost per token against batch size (real tokens), all-MiniLM-L6-v2 fp32, the server's engine."""
import json
import sys
import time

import numpy as np
import torch

from fastbert.serving.engines import EmbedEngine, Tokens
from fastbert.training.corpus import cpython_sentences

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
engine = EmbedEngine(None, "cpu", "float32", "auto", None)
pool = list(cpython_sentences(limit=2000))
ids = [Tokens(t.ids) for t in engine.encode(pool, True)]
rng = np.random.default_rng(0)
out = {"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads()}
for budget in (256, 512, 1024, 2048, 4096, 8192):
    def batch(budget: int = budget):
        chosen, total = [], 0
        while True:
            t = ids[int(rng.integers(len(ids)))]
            if total + len(t) > budget:
                return chosen, total
            chosen.append(t)
            total += len(t)
    for _ in range(3):  # warm (measuring of new shape classes)
        engine.run(batch()[0])
    tokens, seconds = 0, 0.0
    while seconds < 3.0:
        b, n = batch()
        start = time.perf_counter()
        engine.run(b)
        seconds += time.perf_counter() - start
        tokens += n
    out[budget] = round(tokens / seconds)
    print(budget, "tokens/s", out[budget], flush=True)
print(json.dumps(out))
