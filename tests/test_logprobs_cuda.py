"""CUDA-only cases: 64-bit offsets (rows * V > 2**31) and the compiled training step."""

from __future__ import annotations

import pytest
import torch

import torch_fused
from _helpers import assert_fp32_close, ref_logprobs_entropy, rel_err

pytestmark = pytest.mark.cuda


def test_rows_times_vocab_above_2_pow_31():
    v = 151936
    rows = 2**31 // v + 64  # 14198 rows: the last rows start past element 2**31
    full = torch.randn(2, rows // 2 + 1, v, device="cuda", dtype=torch.bfloat16) * 3
    x = full[:, :-1]  # strided view: the outer stride times the batch index passes 2**31 too
    assert x.numel() > 2**31
    idx = torch.randint(0, v, x.shape[:-1], device="cuda")
    xg = x.detach().requires_grad_(True)
    lp, ent = torch_fused.logprobs_and_entropy(xg, idx)
    g = torch.randn_like(ent)
    (dx,) = torch.autograd.grad((lp * g).sum() + (ent * g).sum(), xg)
    # check the rows at both ends of the tensor (and so past the 2**31 element offset)
    for b, sl in [(0, slice(0, 4)), (1, slice(-4, None))]:
        xr = x[b, sl].detach().cpu().double().requires_grad_(True)
        rlp, rent = ref_logprobs_entropy(xr, idx[b, sl].cpu(), 1.0)
        assert_fp32_close(lp[b, sl], rlp, 12.0, "logp")
        assert_fp32_close(ent[b, sl], rent, 12.0, "entropy")
        gr = g[b, sl].cpu().double()
        (rdx,) = torch.autograd.grad((rlp * gr).sum() + (rent * gr).sum(), xr)
        assert rel_err(dx[b, sl], rdx) < 1.2e-2


def test_compiled_pg_step_cuda():
    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 1000, device="cuda", dtype=torch.bfloat16)

    def loss_fn(h, index, adv):
        logits = lin(h)
        logp, ent = torch_fused.logprobs_and_entropy(logits[:, :-1], index)
        return -(adv[:, None] * logp).mean() - 0.01 * ent.mean()

    step = torch.compile(loss_fn, fullgraph=True, dynamic=True)
    for length in (17, 33):
        h = torch.randn(4, length + 1, 64, device="cuda", dtype=torch.bfloat16)
        index = torch.randint(0, 1000, (4, length), device="cuda")
        adv = torch.randn(4, device="cuda")
        loss = step(h, index, adv)
        loss.backward()
        gw = lin.weight.grad.clone()
        lin.weight.grad = None
        ref = loss_fn(h, index, adv)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
        assert rel_err(gw, lin.weight.grad) < 2e-2
        lin.weight.grad = None
