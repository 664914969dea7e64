"""Training on fastbert's fused kernels: the loop with checkpoints and exact resume (`loop`), pretraining data as
the original recipes make it (`masking`), `fastbert pretrain` (`pretrain`), `fastbert finetune` (`finetune`) and the
offline corpora both read (`corpus`)."""

from __future__ import annotations
