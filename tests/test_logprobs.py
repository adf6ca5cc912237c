"""fused::selective_log_softmax, fused::entropy_from_logits, fused::logprobs_and_entropy.

Runs twice in CI: on the CPU reference path, and (tests/test_interpreter.py) with
TRITON_INTERPRET=1, where the same tests drive the real Triton kernels. On the H200 the
cuda-parametrized cases run the compiled kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fused
from torch_fused._library import INTERPRET
from _helpers import DEVICES, GRAD_RTOL, SMALL, assert_fp32_close, make_logits, ref_logprobs_entropy, rel_err  # noqa: E501

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# vocab sizes: 1, primes, around and above one block, and a real vocabulary (rows kept few)
VOCABS = [1, 2, 7, 31, 127, 1000, 4099] if SMALL else [1, 2, 7, 31, 127, 1000, 4099, 9001, 32003, 262144]


@st.composite
def cases(draw):
    v = draw(st.sampled_from(VOCABS))
    max_rows = 6 if (SMALL or v > 10000) else 12
    b = draw(st.integers(0 if not SMALL else 1, 3))
    l = draw(st.integers(1, max(1, max_rows // max(b, 1))))
    return dict(
        v=v,
        b=b,
        l=l,
        dtype=draw(st.sampled_from(DTYPES)),
        layout=draw(st.sampled_from(["contiguous", "sliced", "transposed"])),
        k=draw(st.sampled_from([None, 1, 3])),
        temperature=draw(st.sampled_from([1.0, 0.7, 1.5])),
        scale=draw(st.sampled_from([0.5, 3.0, 1e4 / 4])),
        neg_inf=draw(st.sampled_from([0.0, 0.0, 0.3])),
        ignore_frac=draw(st.sampled_from([0.0, 0.25])),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        seed=draw(st.integers(0, 2**16)),
    )


def _build(c, device):
    gen = torch.Generator().manual_seed(c["seed"])
    x = make_logits((c["b"], c["l"]), c["v"], c["dtype"], device, c["layout"], c["scale"], c["neg_inf"], gen)
    ishape = (c["b"], c["l"]) + ((c["k"],) if c["k"] else ())
    idx = torch.randint(0, c["v"], ishape, generator=gen)
    if c["ignore_frac"]:
        idx = idx.masked_fill(torch.rand(ishape, generator=gen) < c["ignore_frac"], -100)
    return x, idx.to(c["index_dtype"]).to(device)


def _zscale(x, t):
    fin = x[torch.isfinite(x)]
    return fin.abs().max().item() / t if fin.numel() else 1.0


@pytest.mark.parametrize("device", DEVICES)
@given(c=cases())
def test_forward_matches_float64_reference(device, c):
    x, idx = _build(c, device)
    t = c["temperature"]
    lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t)
    rlp, rent = ref_logprobs_entropy(x.cpu(), idx.cpu(), t)
    want = torch.float64 if c["dtype"] == torch.float64 else torch.float32
    assert lp.dtype == want and ent.dtype == want
    assert lp.shape == idx.shape and ent.shape == x.shape[:-1]
    s = _zscale(x.cpu().double(), t)
    assert_fp32_close(lp, rlp, s, "logprobs_and_entropy logp")
    assert_fp32_close(ent, rent, s, "logprobs_and_entropy entropy")
    # the single ops compute the same numbers
    assert_fp32_close(torch_fused.selective_log_softmax(x, idx, temperature=t), rlp, s, "selective_log_softmax")
    assert_fp32_close(torch_fused.entropy_from_logits(x, temperature=t), rent, s, "entropy_from_logits")
    assert bool((lp.cpu()[idx.cpu() == -100] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@given(c=cases(), which=st.sampled_from(["logp", "entropy", "both", "selective"]))
def test_backward_matches_float64_reference(device, c, which):
    x, idx = _build(c, device)
    x.requires_grad_(True)
    t = c["temperature"]
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    g_lp = torch.randn(idx.shape, generator=gen, dtype=torch.float64)
    g_h = torch.randn(x.shape[:-1], generator=gen, dtype=torch.float64)
    if which == "selective":
        lp = torch_fused.selective_log_softmax(x, idx, temperature=t)
        loss = (lp * g_lp.to(device, lp.dtype)).sum()
    else:
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t)
        loss = 0
        if which in ("logp", "both"):
            loss = loss + (lp * g_lp.to(device, lp.dtype)).sum()
        if which in ("entropy", "both"):
            loss = loss + (ent * g_h.to(device, ent.dtype)).sum()
    (dx,) = torch.autograd.grad(loss, x)
    assert dx.dtype == x.dtype and dx.shape == x.shape

    xr = x.detach().cpu().double().requires_grad_(True)
    rlp, rent = ref_logprobs_entropy(xr, idx.cpu(), t)
    rloss = 0
    if which in ("logp", "both", "selective"):
        rloss = rloss + (rlp * g_lp).sum()
    if which in ("entropy", "both"):
        rloss = rloss + (rent * g_h).sum()
    (rdx,) = torch.autograd.grad(rloss, xr)
    fin = torch.isfinite(rdx)
    dx = dx.cpu().double()
    assert bool(torch.isfinite(dx[fin]).all()), "NaN/inf gradient where the reference is finite"
    # fp32 math rounded once to the logits dtype; 1e4-scale logits lose fp32 digits in z - lse
    tol = GRAD_RTOL[c["dtype"]] + (2e-4 if c["scale"] > 100 and c["dtype"] != torch.float64 else 0)
    # floor: fp32 rounding of p ~ 1 terms (e.g. V = 1, where the true gradient is exactly 0),
    # relative to the upstream gradient that scales every term
    g_scale = (g_lp.norm() + g_h.norm()).item() / t
    err = (dx[fin] - rdx[fin]).norm().item()
    assert err <= tol * rdx[fin].norm().item() + 1e-6 * g_scale, (err, rdx[fin].norm().item())
    if c["ignore_frac"] and which in ("logp", "selective"):
        # rows whose every index is ignored receive exactly zero gradient
        ig = idx.cpu() == -100
        row_ignored = ig if c["k"] is None else ig.all(-1)
        assert bool((dx[row_ignored] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_equal_logits_give_log_v_and_masked_vocab_stays_finite(device):
    v = 1000
    x = torch.full((2, 3, v), 5.0, device=device, dtype=torch.bfloat16)
    ent = torch_fused.entropy_from_logits(x)
    torch.testing.assert_close(ent.cpu(), torch.full((2, 3), math.log(v)), rtol=1e-6, atol=1e-6)
    x = x.clone()
    x[..., 10:] = float("-inf")  # masked vocabulary: only 10 live entries
    ent = torch_fused.entropy_from_logits(x)
    torch.testing.assert_close(ent.cpu(), torch.full((2, 3), math.log(10)), rtol=1e-6, atol=1e-6)
    lp = torch_fused.selective_log_softmax(x, torch.full((2, 3), 3, device=device))
    torch.testing.assert_close(lp.cpu(), torch.full((2, 3), -math.log(10)), rtol=1e-6, atol=1e-6)
    # masked entries: log-prob -inf, gradient 0 (not NaN)
    xg = x.float().requires_grad_(True)
    lp, ent = torch_fused.logprobs_and_entropy(xg, torch.full((2, 3), 20, device=device))
    assert bool(torch.isneginf(lp).all())
    (ent.sum()).backward()
    assert bool(torch.isfinite(xg.grad).all()) and bool((xg.grad[..., 10:] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs(device):
    for shape in [(0, 7), (2, 0, 5), (0, 3, 4)]:
        x = torch.randn(shape, device=device, requires_grad=True)
        idx = torch.zeros(shape[:-1], dtype=torch.long, device=device)
        lp, ent = torch_fused.logprobs_and_entropy(x, idx)
        assert lp.shape == shape[:-1] and ent.shape == shape[:-1]
        (lp.sum() + ent.sum()).backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
def test_no_leading_dims(device):
    x = torch.randn(50, device=device, dtype=torch.float64)
    lp = torch_fused.selective_log_softmax(x, torch.tensor(7, device=device))
    assert lp.shape == ()
    torch.testing.assert_close(lp.cpu(), torch.log_softmax(x.cpu(), -1)[7])
    lpk = torch_fused.selective_log_softmax(x, torch.tensor([7, 7, 3], device=device))
    torch.testing.assert_close(lpk.cpu(), torch.log_softmax(x.cpu(), -1)[[7, 7, 3]])


@pytest.mark.parametrize("device", DEVICES)
def test_duplicate_ids_in_k_accumulate_gradient(device):
    x = torch.randn(3, 40, device=device, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[1, 1, 5], [2, 3, 2], [0, 0, 0]], device=device)
    torch_fused.selective_log_softmax(x, idx).sum().backward()
    xr = x.detach().cpu().requires_grad_(True)
    torch.log_softmax(xr, -1).gather(-1, idx.cpu()).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), xr.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_ignore_index_inside_vocab(device):
    """ignore_index may be a real id (e.g. a pad token 0): those positions give 0, no gradient."""
    x = torch.randn(4, 9, device=device, requires_grad=True)
    idx = torch.tensor([0, 3, 0, 8], device=device)
    lp = torch_fused.selective_log_softmax(x, idx, ignore_index=0)
    assert lp[0].item() == 0 and lp[2].item() == 0
    lp.sum().backward()
    assert bool((x.grad[0] == 0).all()) and bool((x.grad[2] == 0).all()) and bool((x.grad[1] != 0).any())


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_index(device):
    x = torch.randn(2, 3, 11, device=device)
    idx = torch.tensor([[1, 11, 2], [-1, 4, -100]], device=device)
    if device == "cpu" and not INTERPRET:
        with pytest.raises(IndexError, match=r"index: value 11 is outside \[0, V=11\)"):
            torch_fused.selective_log_softmax(x, idx)
        with pytest.raises(Exception, match=r"index: value 11 is outside"):
            torch.compile(torch_fused.selective_log_softmax, fullgraph=True, backend="aot_eager")(x, idx)
    else:  # kernels: NaN at exactly the bad positions (documented), never a crash
        lp = torch_fused.selective_log_softmax(x, idx).cpu()
        bad = torch.tensor([[False, True, False], [True, False, False]])
        assert bool(torch.isnan(lp[bad]).all()) and bool(torch.isfinite(lp[~bad]).all())
        assert lp[1, 2].item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_no_copy_of_strided_views(device, monkeypatch):
    """The [:, :-1] slice and transposed leading dims reach the kernel as they are."""
    calls = []
    orig = torch.Tensor.contiguous

    def spy(self, *a, **k):
        if self.dim() == 3 and self.shape[-1] == 64:
            calls.append(tuple(self.stride()))
        return orig(self, *a, **k)

    for layout in ["sliced", "transposed"]:
        x = make_logits((2, 5), 64, torch.bfloat16, device, layout)
        assert not x.is_contiguous()
        monkeypatch.setattr(torch.Tensor, "contiguous", spy)
        lp, ent = torch_fused.logprobs_and_entropy(x, torch.zeros(2, 5, dtype=torch.long, device=device))
        monkeypatch.setattr(torch.Tensor, "contiguous", orig)
        rlp, rent = ref_logprobs_entropy(x.cpu(), torch.zeros(2, 5, dtype=torch.long), 1.0)
        assert_fp32_close(lp, rlp, 10.0, layout)
    if device == "cuda" or INTERPRET:
        assert calls == []  # the Triton launcher made no contiguous copy of the logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_temperature_is_differentiated(device, dtype):
    """A 0-dim tensor temperature is read on the device and gets d T = -(1/T) sum x dx from the
    same backward pass; logits gradients and values agree with the float path."""
    gen = torch.Generator().manual_seed(4)
    x = make_logits((2, 5), 300, dtype, device, "sliced", scale=2.0, gen=gen)  # (-inf: NaN in the f64 autograd ref)
    idx = torch.randint(0, 300, (2, 5), generator=gen).to(device)
    idx[0, 1] = -100
    g1 = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    g2 = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    for which in ("both", "selective", "entropy"):
        xt = x.detach().requires_grad_(True)
        t = torch.tensor(0.8, requires_grad=True)
        if which == "selective":
            loss = (torch_fused.selective_log_softmax(xt, idx, temperature=t).double().cpu() * g1).sum()
        elif which == "entropy":
            loss = (torch_fused.entropy_from_logits(xt, temperature=t).double().cpu() * g2).sum()
        else:
            lp, ent = torch_fused.logprobs_and_entropy(xt, idx, temperature=t)
            loss = (lp.double().cpu() * g1).sum() + (ent.double().cpu() * g2).sum()
        dx, dt = torch.autograd.grad(loss, (xt, t))
        xr = x.detach().cpu().double().requires_grad_(True)
        tr = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
        rlp, rent = ref_logprobs_entropy(xr, idx.cpu(), tr)
        rl = {"selective": (rlp * g1).sum(), "entropy": (rent * g2).sum(),
              "both": (rlp * g1).sum() + (rent * g2).sum()}[which]
        rdx, rdt = torch.autograd.grad(rl, (xr, tr))
        assert rel_err(dx, rdx) <= GRAD_RTOL[dtype], which
        # d T sums x * dx over every element: fp32 terms, bf16-rounded x (exact) but the kernel's
        # dx before rounding, so it is held to fp32-accumulation accuracy relative to its terms
        scale = (xr.detach().abs().nan_to_num(0, 0, 0) * rdx.abs()).sum().item() / 0.8
        assert abs(dt.item() - rdt.item()) <= 1e-4 * scale + 1e-6, (which, dt.item(), rdt.item())
        # the value path is the float path's
        if which == "both":
            assert_fp32_close(lp, rlp.detach(), 10.0, "logp (tensor T)")
    with pytest.raises((ValueError, RuntimeError), match="temperature"):
        torch_fused.selective_log_softmax(x, idx, temperature=torch.tensor([0.5, 1.0]))


def test_tensor_temperature_gradcheck_and_compile():
    x = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 11, (2, 3))
    t = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch_fused.logprobs_and_entropy(a, idx, temperature=b), (x, t))
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: torch_fused.logprobs_and_entropy(a, idx, temperature=b)[1].sum(),
                      fullgraph=True, backend="aot_eager")
    out = f(x, t)
    (g,) = torch.autograd.grad(out, t)
    (g_ref,) = torch.autograd.grad(torch_fused.logprobs_and_entropy(x, idx, temperature=t)[1].sum(), t)
    torch.testing.assert_close(g, g_ref)
    with pytest.raises(ValueError, match="temperature: expected a positive number"):
        torch_fused.selective_log_softmax(x.detach(), idx, temperature=torch.tensor(-1.0, dtype=torch.float64))
