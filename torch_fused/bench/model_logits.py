"""Log-probs and entropy of logits as a model makes them: a matmul output ``[B, L+1, V]``
(bf16) that is not a leaf, read with ``shift=True`` against the ``[:, :-1]`` slice that RL
trainers pass (whose autograd backward allocates a zeroed ``[B, L+1, V]`` buffer and copies
the gradient into it). Timed: forward and backward from the logits to their gradient, eager
and under ``torch.compile(fullgraph=True)``. Floor: read, read, write of the logits.
"""

from __future__ import annotations

import torch

import torch_fused

from .common import Row, bench_ms, peak_extra_mb, warm_up
from .logprobs import SHAPES, plain_entropy, plain_selective


def _loss_shift(logits, idx):
    lp, ent = torch_fused.logprobs_and_entropy(logits, idx, shift=True)
    return lp.sum() + ent.sum()


def _loss_slice(logits, idx):
    lp, ent = torch_fused.logprobs_and_entropy(logits[:, :-1], idx)
    return lp.sum() + ent.sum()


def _loss_plain(logits, idx):
    x = logits[:, :-1]
    return plain_selective(x, idx).sum() + plain_entropy(x).sum()


def run(report, copy_gbps, quick=False):
    for b, l, v in SHAPES[:1] if quick else SHAPES:
        torch._dynamo.reset()
        hd = 256  # the matmul only has to put the logits in the graph; its cost is not timed
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(b, l + 1, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
        w = torch.randn(v, hd, device="cuda", dtype=torch.bfloat16, generator=g) / hd**0.5 * 3
        logits = h @ w.t()  # a non-leaf [B, L+1, V], as a model's forward leaves it
        idx = torch.randint(0, v, (b, l), device="cuda", generator=g)
        shape = f"B{b} L{l} V{v}"
        floor = 3 * b * l * v * 2

        def timed(loss_fn):
            def run_once():
                return torch.autograd.grad(loss_fn(logits, idx), logits, retain_graph=True)[0]
            return run_once

        cases = [("torch_fused shift=True", _loss_shift), ("torch_fused on [:, :-1]", _loss_slice),
                 ("torch_fused shift=True, compiled", torch.compile(_loss_shift, fullgraph=True)),
                 ("torch_fused on [:, :-1], compiled", torch.compile(_loss_slice, fullgraph=True)),
                 ("torch.compile plain on [:, :-1]", torch.compile(_loss_plain, fullgraph=True))]
        warm_up(timed(_loss_shift))
        for impl, fn in cases:
            f = timed(fn)
            ms = bench_ms(f)
            pk = peak_extra_mb(f)
            report.rows.append(Row("model logits fwd+bwd", shape, impl, ms, floor, peak_extra_mb=pk,
                                   note="peak extra includes the returned gradient").finish(copy_gbps))
            print(f"model logits fwd+bwd {shape:24s} {impl:36s} {ms:8.3f} ms  "
                  f"{report.rows[-1].frac_floor:.3f} of floor  peak extra {pk:.0f} MiB", flush=True)
        report.extra.setdefault("logits_mib", {})[shape] = b * (l + 1) * v * 2 / 2**20
        del h, w, logits, idx
        torch.cuda.empty_cache()
