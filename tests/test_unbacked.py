"""The log-prob ops and the masked helpers under torch.compile(fullgraph=True) with unbacked
(data-dependent) sizes: rows packed with ``nonzero()``, whose count the compiler cannot know.
The input checks must not decide such a size with a guard (a data-dependent-guard error)."""

from __future__ import annotations

import pytest
import torch

import torch_fused
from _helpers import DEVICES
from torch_fused._library import INTERPRET


def _packed_logprobs(logits, idx, keep_mask, w):
    keep = keep_mask.nonzero().squeeze(-1)  # an unbacked count u0
    x, i = logits[keep], idx[keep]
    lp, ent = torch_fused.logprobs_and_entropy(x, i)
    lp2 = torch_fused.selective_log_softmax(x, i, temperature=0.7)
    ent2 = torch_fused.entropy_from_logits(x)
    return (lp * 0.3 + ent - lp2 + ent2 * 0.1).sum()


def _two_packings(logits, idx, keep_mask, w):
    # the loss and its mask packed by two nonzero() calls: sizes u0 and u1, equal at run time only
    keep, keep2 = keep_mask.nonzero().squeeze(-1), keep_mask.nonzero().squeeze(-1)
    lp = torch_fused.selective_log_softmax(logits[keep], idx[keep])
    m = w[keep2]
    total = torch_fused.masked_mean(lp, m)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        total = total + torch_fused.aggregate_loss(lp[None], m[None], mode)
    return total


def _packed_rows_reduced(logits, idx, keep_mask, w):
    keep = keep_mask.nonzero().squeeze(-1)
    x = logits[keep]
    return (torch_fused.mask_reduce(x, 0, w[keep][:, None]).sum()
            + torch_fused.masked_mean(x, w[keep][:, None], dim=0).sum()
            + torch_fused.masked_mean(x, w[keep][:, None]))


@pytest.mark.skipif(INTERPRET, reason="tracing with unbacked sizes: the plain CPU run covers it (the ops stay "
                                       "whole there; the inlined launches are CUDA's)")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [_packed_logprobs, _two_packings, _packed_rows_reduced],
                         ids=["logprob-ops", "two-packings", "mask-reduce"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_with_nonzero_packing_equals_eager(device, fn, dynamic):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _compare(device, fn, dynamic)


def _compare(device, fn, dynamic):
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"
    step = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)
    g = torch.Generator().manual_seed(0)
    for n in (10, 13):  # two batches: different packed counts through the same graph
        logits = torch.randn(n, 17, generator=g).to(device)
        idx = torch.randint(0, 17, (n,), generator=g).to(device)
        keep_mask = (torch.rand(n, generator=g) > 0.4).to(device)
        w = (torch.rand(n, generator=g) > 0.3).to(device)
        grads = []
        for f in (fn, step):
            x = logits.clone().requires_grad_(True)
            out = f(x, idx, keep_mask, w)
            out.backward()
            grads.append((out.detach(), x.grad))
        torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-5)
