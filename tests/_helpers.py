"""Shared test helpers: float64 reference formulas (independent of torch_fused.reference),
input builders and comparisons."""

from __future__ import annotations

import pytest
import torch

from torch_fused._library import INTERPRET

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# Tolerances on gradients, which are rounded to the logits dtype (forward outputs are float32
# for every input dtype and are held to fp32 accuracy).
GRAD_RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 2e-5, torch.float64: 1e-10}


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


def assert_fp32_close(out, ref, scale, what):
    """out (float32) vs float64 ref to fp32 accuracy: NaN exactly where ref is NaN, and
    |out - ref| <= 2e-5 * (|ref| + scale), scale being the magnitude of the z = x/T that entered
    the fp32 arithmetic (so |x| ~ 1e4 is held to fp32 relative accuracy, no more)."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    out = out.double().cpu()
    ref = ref.double().cpu()
    torch.testing.assert_close(torch.isnan(out), torch.isnan(ref), msg=f"{what}: NaN pattern differs")
    fin = ~torch.isnan(ref)
    err = (out[fin] - ref[fin]).abs()
    bound = 2e-5 * (ref[fin].abs() + max(1.0, scale))
    bad = err > bound
    assert not bool(bad.any()), f"{what}: max err {err.max().item():.3g}, worst idx {bad.nonzero()[:3].tolist()}"


def rel_err(a, b):
    a = a.double().cpu()
    b = b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


SMALL = INTERPRET  # the interpreter runs kernels in Python: keep shapes small there
