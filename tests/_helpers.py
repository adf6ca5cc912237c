"""Shared test helpers: float64 reference formulas (independent of torch_fused.reference),
input builders and comparisons."""

from __future__ import annotations

import math

import pytest
import torch

from torch_fused._library import INTERPRET

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


# Per-element tolerances. Forward outputs are float32 for every input dtype (bf16/fp16 logits
# are exact in fp32) and are held to fp32 accuracy: |out - ref| <= FWD_RTOL * (|ref| + 1 + ln V),
# the error of fp32 arithmetic on log p, plus a floor for the rounding of log s (a sum of V
# terms). Measured worst case of the kernels and the reference: 1.4e-7 of that bound's unit.
FWD_RTOL = {torch.float16: 4e-6, torch.bfloat16: 4e-6, torch.float32: 4e-6, torch.float64: 1e-12}
# Gradients are rounded once to the logits dtype: one ulp of the element itself (the Triton
# interpreter truncates to bf16, the GPU rounds to nearest), which below the dtype's smallest
# normal is the subnormal spacing, tiny * eps (fp16: 6e-8 under 6.1e-5, a gradient element such
# as 1.3e-5 is stored to that absolute step), plus an fp32 floor relative to the row's upstream
# gradient (sum |g| + |g_H|) / T that every element of the row is a multiple of.
GRAD_RTOL = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 4e-6, torch.float64: 1e-10}
GRAD_FLOOR = {torch.float16: 2e-6, torch.bfloat16: 2e-6, torch.float32: 2e-6, torch.float64: 1e-10}


def ref_logprobs_entropy(x, index, temperature, ignore_index=-100):
    """float64: log_softmax(x / T) at index (0 at ignore_index) and the entropy, by autograd-able
    torch formulas. index may be None, [...] or [..., K]."""
    z = torch.log_softmax(x.double() / temperature, -1)
    p = z.exp()
    ent = -(torch.where(p > 0, p * z, torch.zeros_like(z))).sum(-1)
    if index is None:
        return None, ent
    single = index.dim() == x.dim() - 1
    ii = (index[..., None] if single else index).long()
    lp = z.gather(-1, ii.clamp(0, x.shape[-1] - 1))
    lp = torch.where(ii == ignore_index, torch.zeros_like(lp), lp)
    return (lp[..., 0] if single else lp), ent


def make_logits(shape_lead, v, dtype, device, layout, scale=3.0, neg_inf_frac=0.0, gen=None):
    """Logits [B, L, V] in one of the layouts users hand us:
    'contiguous', 'sliced' (x[:, :-1] of a [B, L+1, V] tensor) or 'transposed' (a [L, B, V]
    tensor with its leading dims swapped). Values are randn * scale, cast to dtype."""
    b, l = shape_lead
    x = torch.randn(b, l, v, generator=gen, dtype=torch.float64) * scale
    if neg_inf_frac > 0:
        m = torch.rand(x.shape, generator=gen, dtype=torch.float64) < neg_inf_frac
        m[..., 0] = False  # keep one finite entry per row
        x = x.masked_fill(m, float("-inf"))
    if layout == "sliced":
        buf = torch.zeros(b, l + 1, v, dtype=dtype, device=device)
        buf[:, :-1] = x.to(dtype)
        return buf[:, :-1]
    if layout == "transposed":
        return x.transpose(0, 1).contiguous().to(dtype).to(device).transpose(0, 1)
    return x.to(dtype).to(device)


def assert_logprob_close(out, ref, v, what, dtype=torch.float32):
    """out vs the float64 ref, element by element: NaN exactly where ref is NaN, equal infinities,
    and |out - ref| <= FWD_RTOL[dtype] * (|ref| + 1 + ln V) elsewhere (dtype: the logits')."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    out = out.double().cpu()
    ref = ref.double().cpu()
    torch.testing.assert_close(torch.isnan(out), torch.isnan(ref), msg=f"{what}: NaN pattern differs")
    inf = torch.isinf(ref)
    assert bool((out[inf] == ref[inf]).all()), f"{what}: infinities differ"
    fin = torch.isfinite(ref)
    err = (out[fin] - ref[fin]).abs()
    bound = FWD_RTOL[dtype] * (ref[fin].abs() + 1.0 + math.log(max(v, 1)))
    bad = err > bound
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} elements off, worst err {err.max().item():.3g} "
        f"(bound there {bound[err.argmax()].item():.3g})")


def assert_grad_close(dx, rdx, row_scale, dtype, what):
    """d logits vs the float64 autograd reference, element by element:
    |dx - rdx| <= GRAD_RTOL[dtype] |rdx| + GRAD_FLOOR[dtype] * row_scale + tiny * eps (the
    dtype's subnormal step), where row_scale ([..., 1], broadcast over V) is the row's
    (sum |g_logp| + |g_entropy|) / T."""
    dx = dx.double().cpu()
    rdx = rdx.double().cpu()
    fin = torch.isfinite(rdx)
    assert bool(torch.isfinite(dx[fin]).all()), f"{what}: NaN/inf gradient where the reference is finite"
    fi = torch.finfo(dtype)
    bound = (GRAD_RTOL[dtype] * rdx.abs() + GRAD_FLOOR[dtype] * row_scale.double().cpu().expand_as(rdx)
             + fi.tiny * fi.eps)
    err = torch.where(fin, (dx - rdx).abs(), torch.zeros_like(dx))
    bad = err > bound
    if not bool(bad.any()):
        return
    worst = (err - bound).argmax()
    raise AssertionError(
        f"{what}: {int(bad.sum())} elements off; furthest over its bound: {dx.reshape(-1)[worst].item():.6g} "
        f"against {rdx.reshape(-1)[worst].item():.6g} (err {err.reshape(-1)[worst].item():.3g}, "
        f"bound {bound.reshape(-1)[worst].item():.3g})")


def rel_err(a, b):
    a = a.double().cpu()
    b = b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


SMALL = INTERPRET  # the interpreter runs kernels in Python: keep shapes small there


def ref_linear(h, w, idx, bias=None, t=1.0, scale=1.0, softcap=None, shift=False, ignore_index=-100):
    """The materialized float64 path."""
    h, w = h.double(), w.double()
    if shift:
        h = h[..., :-1, :]
    y = h @ w.t()
    if bias is not None:
        y = y + bias.double()
    y = y * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    z = torch.log_softmax(y / t, -1)
    single = idx.dim() == h.dim() - 1
    ii = (idx[..., None] if single else idx).long()
    lp = z.gather(-1, ii.clamp(0, w.shape[0] - 1))
    lp = torch.where(ii == ignore_index, torch.zeros_like(lp), lp)
    ent = -(z.exp() * z).sum(-1)
    return (lp[..., 0] if single else lp), ent
