"""What a stateless optimizer buys at scale: the training-step suite at Llama-3-8B's shape.

The model, the step and the three paths are bench/step.py's, at ``step.LLAMA3_8B``: 32 layers,
hidden 4096, 32 query and 8 key/value heads, MLP 14336, vocabulary 128256 (untied head), bf16
parameters (8.0B), full-parameter training with activation checkpointing per block, sequences of
4096 tokens. Paths:
  materialized  the [B, S, V] logits and an fp32 log_softmax; torch.optim.AdamW(fused=True)
  trl           TRL's chunked lm_head; torch.optim.AdamW(fused=True)
  torch_fused   the fused head (``linear_logprobs_and_entropy(..., shift=True)``); SinkGD with
                stochastic rounding on the hidden matrices, AdamW on embeddings, head and norms

Reported (eager only: compiling 32 checkpointed blocks for every candidate batch would dominate
the run): memory held between steps (parameters + optimizer state), peak memory of one step at
micro-batch 1, the largest micro-batch each path fits, and tokens/s there.

``python -m torch_fused.bench step_8b`` on one GPU with about 100 GB free (the AdamW paths hold
the parameters and two bf16 moments, 48 GB, before any activation); ``--quick``: 4 layers of the
same shape, the largest batch by doubling only. On CPU, ``python -m torch_fused.bench.step
--preset tiny --checkpoint 1 --kv-heads 2`` runs the same code paths at a tiny size.
"""

from __future__ import annotations

from dataclasses import asdict

from . import step

markdown = step.markdown
save = step.save


def run(report, copy_gbps, quick=False, device="cuda"):
    cfg = step.Config(**asdict(step.LLAMA3_8B))
    if quick:
        cfg.layers = 4
    kw = dict(modes=("eager",), reps=3, max_batch_cap=64, budget_s=120 if quick else 360, bisect=not quick)
    step.run_config(report, cfg, quick, device, **kw)
