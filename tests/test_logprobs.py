"""fused::selective_log_softmax, fused::entropy_from_logits, fused::logprobs_and_entropy.

Runs twice in CI: on the CPU reference path, and (tests/test_interpreter.py) with
TRITON_INTERPRET=1, where the same tests drive the real Triton kernels. On the H200 the
cuda-parametrized cases run the compiled kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, strategies as st

import torch_fused
from torch_fused._library import INTERPRET
from _helpers import DEVICES, SMALL, assert_grad_close, assert_logprob_close, make_logits, ref_logprobs_entropy

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# vocab sizes: 1, primes, around and above one block, and a real vocabulary (rows kept few)
VOCABS = [1, 2, 7, 31, 127, 300] if SMALL else [1, 2, 7, 31, 127, 1000, 4099, 9001, 32003, 262144]


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
        layout=draw(st.sampled_from(["contiguous", "sliced", "transposed", "shift"])),
        k=draw(st.sampled_from([None, 1, 3])),
        temperature=draw(st.sampled_from([1.0, 0.7, 1.5])),
        scale=draw(st.sampled_from([0.5, 3.0, 1e4 / 4])),
        neg_inf=draw(st.sampled_from([0.0, 0.0, 0.3])),
        ignore_frac=draw(st.sampled_from([0.0, 0.25])),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        seed=draw(st.integers(0, 2**16)),
    )


def _build(c, device):
    """(logits, index, shift): with the 'shift' layout the logits are the model's [B, L+1, V] and
    the op drops the last position itself."""
    gen = torch.Generator().manual_seed(c["seed"])
    shift = c["layout"] == "shift"
    lead = (c["b"], c["l"] + 1) if shift else (c["b"], c["l"])
    x = make_logits(lead, c["v"], c["dtype"], device, "contiguous" if shift else c["layout"], c["scale"],
                    c["neg_inf"], gen)
    ishape = (c["b"], c["l"]) + ((c["k"],) if c["k"] else ())
    idx = torch.randint(0, c["v"], ishape, generator=gen)
    if c["ignore_frac"]:
        idx = idx.masked_fill(torch.rand(ishape, generator=gen) < c["ignore_frac"], -100)
    return x, idx.to(c["index_dtype"]).to(device), shift


def _scored(x, shift):
    """The logits rows the op scores."""
    return x[..., :-1, :] if shift else x


@pytest.mark.parametrize("device", DEVICES)
@given(c=cases())
def test_forward_matches_float64_reference(device, c):
    x, idx, shift = _build(c, device)
    t = c["temperature"]
    v = c["v"]
    lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t, shift=shift)
    rlp, rent = ref_logprobs_entropy(_scored(x, shift).cpu(), idx.cpu(), t)
    want = torch.float64 if c["dtype"] == torch.float64 else torch.float32
    assert lp.dtype == want and ent.dtype == want
    assert lp.shape == idx.shape and ent.shape == rent.shape
    dt = c["dtype"]
    assert_logprob_close(lp, rlp, v, "logprobs_and_entropy logp", dt)
    assert_logprob_close(ent, rent, v, "logprobs_and_entropy entropy", dt)
    # the single ops compute the same numbers
    assert_logprob_close(torch_fused.selective_log_softmax(x, idx, temperature=t, shift=shift), rlp, v,
                         "selective_log_softmax", dt)
    assert_logprob_close(torch_fused.entropy_from_logits(x, temperature=t, shift=shift), rent, v,
                         "entropy_from_logits", dt)
    assert bool((lp.cpu()[idx.cpu() == -100] == 0).all())


# an fp16 gradient element of 1.3e-5, stored as a subnormal (its step is 6e-8, not 2^-10 of it)
_SUBNORMAL_GRAD = dict(v=127, b=1, l=2, dtype=torch.float16, layout="contiguous", k=None, temperature=1.0, scale=0.5,
                       neg_inf=0.0, ignore_frac=0.0, index_dtype=torch.int64, seed=2377)


@pytest.mark.parametrize("device", DEVICES)
@given(c=cases(), which=st.sampled_from(["logp", "entropy", "both", "selective"]))
@example(c=_SUBNORMAL_GRAD, which="logp")
def test_backward_matches_float64_reference(device, c, which):
    x, idx, shift = _build(c, device)
    x.requires_grad_(True)
    t = c["temperature"]
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    g_lp = torch.randn(idx.shape, generator=gen, dtype=torch.float64)
    g_h = torch.randn(_scored(x, shift).shape[:-1], generator=gen, dtype=torch.float64)
    if which == "selective":
        lp = torch_fused.selective_log_softmax(x, idx, temperature=t, shift=shift)
        loss = (lp * g_lp.to(device, lp.dtype)).sum()
    else:
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t, shift=shift)
        loss = 0
        if which in ("logp", "both"):
            loss = loss + (lp * g_lp.to(device, lp.dtype)).sum()
        if which in ("entropy", "both"):
            loss = loss + (ent * g_h.to(device, ent.dtype)).sum()
    (dx,) = torch.autograd.grad(loss, x)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    if shift:  # the dropped position receives exactly zero
        assert bool((dx[..., -1, :] == 0).all())
        dx = dx[..., :-1, :]

    xr = _scored(x, shift).detach().cpu().double().requires_grad_(True)
    rlp, rent = ref_logprobs_entropy(xr, idx.cpu(), t)
    rloss = 0
    use_lp = which in ("logp", "both", "selective")
    use_h = which in ("entropy", "both")
    if use_lp:
        rloss = rloss + (rlp * g_lp).sum()
    if use_h:
        rloss = rloss + (rent * g_h).sum()
    (rdx,) = torch.autograd.grad(rloss, xr)
    # every element of a row's gradient is a multiple of its upstream gradients
    g_row = torch.zeros(rent.shape, dtype=torch.float64)
    if use_lp:
        ig = (idx.cpu() != -100).double()
        g_row = g_row + ((g_lp.abs() * ig).sum(-1) if c["k"] else g_lp.abs() * ig)
    if use_h:
        g_row = g_row + g_h.abs()
    assert_grad_close(dx, rdx, g_row[..., None] / t, c["dtype"], f"d logits ({which})")
    if c["ignore_frac"] and which in ("logp", "selective"):
        # rows whose every index is ignored receive exactly zero gradient
        ig = idx.cpu() == -100
        row_ignored = ig if c["k"] is None else ig.all(-1)
        assert bool((dx.cpu()[row_ignored] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_large_logits_absolute_error(device, offset):
    """Logits near +-1e4 with an O(1) spread: log-probs and entropy within 1e-4 nats of the
    float64 value, and the gradient to fp32 accuracy. A log-sum-exp kept as one fp32 number
    (~1.4e4 in base 2, an ulp of 1e-3) would be off by up to ~3e-4 nats here."""
    gen = torch.Generator().manual_seed(7)
    v, rows = (40, (2, 3)) if SMALL else (5000, (4, 6))
    for t in (1.0, 0.7):
        x64 = offset + 3 * torch.randn(*rows, v, generator=gen, dtype=torch.float64)
        x = x64.float().to(device).requires_grad_(True)
        idx = torch.randint(0, v, rows, generator=gen).to(device)
        # the index at the row max too, where the log-prob is near 0
        idx[:, 0] = x.detach()[:, 0].argmax(-1)
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t)
        xr = x.detach().cpu().double().requires_grad_(True)
        rlp, rent = ref_logprobs_entropy(xr, idx.cpu(), t)
        assert (lp.double().cpu() - rlp).abs().max().item() <= 1e-4, "logp"
        assert (ent.double().cpu() - rent).abs().max().item() <= 1e-4, "entropy"
        g1 = torch.randn(rows, generator=gen, dtype=torch.float64)
        g2 = torch.randn(rows, generator=gen, dtype=torch.float64)
        (dx,) = torch.autograd.grad((lp.double().cpu() * g1).sum() + (ent.double().cpu() * g2).sum(), x)
        (rdx,) = torch.autograd.grad((rlp * g1).sum() + (rent * g2).sum(), xr)
        assert_grad_close(dx, rdx, (g1.abs() + g2.abs())[..., None] / t, torch.float32, f"d logits T={t}")


@pytest.mark.parametrize("device", DEVICES)
def test_equal_logits_give_log_v_and_masked_vocab_stays_finite(device):
    v = 100 if SMALL else 1000
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
        assert_logprob_close(lp, rlp, 64, layout)
    if device == "cuda" or INTERPRET:
        assert calls == []  # the Triton launcher made no contiguous copy of the logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_temperature_is_differentiated(device, dtype):
    """A 0-dim tensor temperature is read on the device and gets d T = -(1/T) sum x dx from the
    same backward pass; logits gradients and values agree with the float path."""
    gen = torch.Generator().manual_seed(4)
    v = 48 if SMALL else 300
    x = make_logits((2, 5), v, dtype, device, "sliced", scale=2.0, gen=gen)  # (-inf: NaN in the f64 autograd ref)
    idx = torch.randint(0, v, (2, 5), generator=gen).to(device)
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
        g_row = {"selective": g1.abs() * (idx.cpu() != -100), "entropy": g2.abs(),
                 "both": g1.abs() * (idx.cpu() != -100) + g2.abs()}[which]
        assert_grad_close(dx, rdx, g_row[..., None] / 0.8, dtype, which)
        # d T sums x * dx over every element: fp32 terms, bf16-rounded x (exact) but the kernel's
        # dx before rounding, so it is held to fp32-accumulation accuracy relative to its terms
        scale = (xr.detach().abs().nan_to_num(0, 0, 0) * rdx.abs()).sum().item() / 0.8
        assert abs(dt.item() - rdt.item()) <= 1e-4 * scale + 1e-6, (which, dt.item(), rdt.item())
        # the value path is the float path's
        if which == "both":
            assert_logprob_close(lp, rlp.detach(), v, "logp (tensor T)")
    with pytest.raises(ValueError, match="temperature: expected a float or a 1-element tensor"):
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
    for bad in (-1.0, 0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
            torch_fused.selective_log_softmax(x.detach(), idx, temperature=torch.tensor(bad, dtype=torch.float64))
        with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
            torch_fused.selective_log_softmax(x.detach(), idx, temperature=bad)


def _graph_nodes(fn):
    """Names of every autograd node reachable from grad_fn."""
    seen, stack, names = set(), [fn], []
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.append(type(f).__name__)
        stack.extend(n for n, _ in f.next_functions)
    return names


@pytest.mark.parametrize("device", DEVICES)
def test_shift_reads_model_logits_without_a_slice_node(device):
    """Logits from a matmul, as a model makes them: with shift=True the autograd graph holds the
    op's node straight over the matmul (no slice node, whose backward would allocate a zeroed
    [B, L+1, V] buffer), the values equal the [:, :-1] call's, and the last position's gradient
    is exactly zero."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 7, 16, generator=gen).to(device)
    w = torch.randn(40, 16, generator=gen).to(device).requires_grad_(True)
    idx = torch.randint(0, 40, (2, 6), generator=gen).to(device)
    logits = h @ w.t()  # [2, 7, 40]
    lp, ent = torch_fused.logprobs_and_entropy(logits, idx, shift=True)
    names = _graph_nodes(lp.grad_fn)
    assert not any("Slice" in n or "Select" in n for n in names), names
    lp2, ent2 = torch_fused.logprobs_and_entropy(logits[:, :-1], idx)
    torch.testing.assert_close(lp, lp2, rtol=0, atol=0)
    torch.testing.assert_close(ent, ent2, rtol=0, atol=0)
    (dl,) = torch.autograd.grad((lp * 0.3).sum() + ent.sum(), logits)
    (dl2,) = torch.autograd.grad((lp2 * 0.3).sum() + ent2.sum(), logits)
    assert bool((dl[:, -1] == 0).all())
    torch.testing.assert_close(dl, dl2, rtol=0, atol=0)
    # a model with no position to score: [B, 1, V] gives [B, 0] and an all-zero gradient
    x1 = torch.randn(3, 1, 40, device=device, requires_grad=True)
    lp0, ent0 = torch_fused.logprobs_and_entropy(x1, torch.zeros(3, 0, dtype=torch.long, device=device), shift=True)
    assert lp0.shape == (3, 0) and ent0.shape == (3, 0)
    (d0,) = torch.autograd.grad(lp0.sum() + ent0.sum(), x1)
    assert d0.shape == x1.shape and bool((d0 == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_shift_top_k_and_more_leading_dims(device):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 3, 5, 33, generator=gen) * 2).to(device).requires_grad_(True)
    idx = torch.randint(0, 33, (2, 3, 4, 2), generator=gen).to(device)
    idx[0, 1, 2, 0] = -100
    lp = torch_fused.selective_log_softmax(x, idx, shift=True, temperature=0.9)
    xr = x.detach().cpu().double()[..., :-1, :].requires_grad_(True)
    rlp, _ = ref_logprobs_entropy(xr, idx.cpu(), 0.9)
    assert_logprob_close(lp, rlp, 33, "shift top-K")
    g = torch.randn(idx.shape, generator=gen, dtype=torch.float64)
    (dx,) = torch.autograd.grad((lp.double().cpu() * g).sum(), x)
    (rdx,) = torch.autograd.grad((rlp * g).sum(), xr)
    assert bool((dx[..., -1, :] == 0).all())
    row = (g.abs() * (idx.cpu() != -100)).sum(-1, keepdim=True) / 0.9
    assert_grad_close(dx[..., :-1, :], rdx, row, torch.float32, "shift top-K grad")


SHIFT_BAD = [
    ("index as long as the logits", (2, 6, 50), (2, 6), r"shift=True.*\(2, 6, 50\).*\(2, 6\)"),
    ("index two shorter", (2, 6, 50), (2, 4, 3), r"shift=True.*\(2, 6, 50\).*\(2, 4, 3\)"),
    ("1-d logits", (50,), (), r"logits: shift=True needs logits \[\.\.\., L\+1, V\]"),
]


@pytest.mark.parametrize("name,xs,ishape,msg", SHIFT_BAD, ids=[b[0] for b in SHIFT_BAD])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_shift_lengths_that_do_not_fit(name, xs, ishape, msg, mode):
    def f(x, i):
        return torch_fused.selective_log_softmax(x, i, shift=True)

    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=msg):
        f(torch.randn(xs), torch.zeros(ishape, dtype=torch.long))


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_temperature_gradient_with_very_negative_logits(device):
    """Logits far below 0 (row max * c < -128) with V not a multiple of the block: the lanes
    past V of the last block must stay out of d T (there p = 2^(-m c - log2 s) overflows)."""
    gen = torch.Generator().manual_seed(11)
    for v in (100, 37):
        x = (torch.randn(3, v, generator=gen, dtype=torch.float64) - 100).float().to(device).requires_grad_(True)
        t = torch.tensor(0.5, device=device, requires_grad=True)
        idx = torch.randint(0, v, (3,), generator=gen).to(device)
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t)
        (dt,) = torch.autograd.grad(lp.sum() + ent.sum(), t)
        xr = x.detach().cpu().double()
        tr = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
        rlp, rent = ref_logprobs_entropy(xr, idx.cpu(), tr)
        (rdt,) = torch.autograd.grad(rlp.sum() + rent.sum(), tr)
        assert math.isfinite(dt.item()), v
        assert abs(dt.item() - rdt.item()) <= 1e-4 * abs(rdt.item()) + 1e-3, (v, dt.item(), rdt.item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["expanded", "transposed"])
def test_upstream_gradients_of_any_strides(device, layout):
    """The backward reads the upstream gradients through their strides: an expanded one (a
    ``.sum()``'s, stride 0) and a transposed one give the gradient of their contiguous copy,
    exactly, for K ids per row and for the entropy."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 37, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 37, (6, 3), generator=g).to(device)
    lp, ent = torch_fused.logprobs_and_entropy(x, idx)
    if layout == "expanded":
        g_lp = torch.tensor(0.7, device=device).expand(6, 3)
        g_ent = torch.tensor(-1.3, device=device).expand(6)
    else:
        g_lp = torch.randn(3, 6, generator=g).to(device).t()
        g_ent = torch.randn(2, 6, generator=g).to(device)[1]
    assert not g_lp.is_contiguous()
    got = torch.autograd.grad((lp, ent), x, (g_lp, g_ent), retain_graph=True)[0]
    want = torch.autograd.grad((lp, ent), x, (g_lp.contiguous(), g_ent.contiguous()))[0]
    assert torch.equal(got, want)
