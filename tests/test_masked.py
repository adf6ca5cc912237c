"""The helpers of torch_fused.masked: the cost model, masked_mean and aggregate_loss (bool and
integer masks keep at weight 1, float masks weigh, as the plain float64 formula
(x * w).sum(dim) / w.sum(dim); errors that name the caller's arguments, eager and compiled)."""

from __future__ import annotations

import pytest
import torch

import torch_fused
from torch_fused._library import INTERPRET
from torch_fused.masked import AGG_MODES

TOL = dict(rtol=1e-6, atol=1e-7)


def test_mask_reduce_cost_counts_stored_elements():
    x = torch.randn(6, 4, 10, dtype=torch.bfloat16)
    keep = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)[:, None, None].expand(6, 4, 10)
    c = torch_fused.mask_reduce_cost(x, 1, keep)
    assert c["elements"] == 240 and c["mask_stored"] == 6
    assert c["kept"] == 3 * 4 * 10 and c["adds"] == 120 and c["loads"] == 126
    assert c["floor_bytes"] == 240 * 2 + 6 + 6 * 10 * 2
    assert c["bytes"] == 120 * 2 + 6 + 120
    assert c["materialized_mask_bytes"] == 240


@pytest.mark.parametrize("args,msg", [
    ((torch.randn(3, 4), 7), r"dim: expected a dim of x"),
    ((torch.randn(3, 4), 1.0), r"dim: expected an int, got float"),
    ((torch.ones(3, 4, dtype=torch.int32), 1), r"x: expected dtype float16, bfloat16, float32 or float64"),
    ((torch.randn(1, 1, 1, 1, 2), 1), r"x: expected 1 to 4 dims"),
    ((torch.randn(3, 4), 1, torch.ones(3, 5, dtype=torch.bool)), r"mask: shape \(3, 5\) does not broadcast"),
])
def test_mask_reduce_cost_checks_its_arguments_as_mask_reduce(args, msg):
    """mask_reduce_cost returned numbers for arguments mask_reduce refuses; now the same errors."""
    for fn in (torch_fused.mask_reduce, torch_fused.mask_reduce_cost):
        with pytest.raises(RuntimeError, match=msg):
            fn(*args)


def _weights_of(mask, shape):
    """float64 weights of a helper's mask broadcast to shape: a floating mask's values, 1 where a
    bool or integer mask is nonzero."""
    m = torch.broadcast_to(mask, shape)
    return m.double() if m.is_floating_point() else (m != 0).double()


def _div(num, den):
    """num / den, 0 where den == 0 (a safe denominator: no NaN in a float64 reference gradient)."""
    nz = den != 0
    return torch.where(nz, num / torch.where(nz, den, torch.ones_like(den)), torch.zeros_like(num))


def _expected(loss, mask):
    """float64 per-row sums S_b = sum_t loss * w and weight sums W_b = sum_t w (the plain formula's
    numerators and denominators)."""
    w = _weights_of(mask, loss.shape)
    return (loss.double() * w).sum(1), w.sum(1)


def _check_all(loss, mask):
    """masked_mean and every aggregate_loss mode on (loss, mask) against the plain float64 formula
    (loss * w).sum(dim) / w.sum(dim) (0 where w.sum(dim) == 0)."""
    s, n = _expected(loss, mask)
    assert n.sum() != 0
    torch.testing.assert_close(torch_fused.masked_mean(loss, mask).double(), s.sum() / n.sum(), **TOL)
    mm = torch_fused.masked_mean(loss, mask, dim=1).double()
    rows = n != 0
    torch.testing.assert_close(mm[rows], (s / n)[rows], **TOL)
    assert bool((mm[~rows] == 0).all())
    agg = lambda mode: torch_fused.aggregate_loss(loss, mask, mode).double()  # noqa: E731
    torch.testing.assert_close(agg("token-mean"), s.sum() / n.sum(), **TOL)
    torch.testing.assert_close(agg("seq-mean-token-mean"), (s[rows] / n[rows]).mean(), **TOL)
    torch.testing.assert_close(agg("seq-mean-token-sum"), s.mean(), **TOL)
    torch.testing.assert_close(agg("seq-mean-token-sum-norm"), s.sum() / loss.shape[1], **TOL)


def _loss_and_keep(seed=0):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(4, 6, generator=g)
    keep = torch.rand(4, 6, generator=g) > 0.4
    keep[2] = False  # an empty row
    keep[0, 0] = True
    return loss, keep


@pytest.mark.parametrize("kind", ["bool", "int64", "uint8", "float32", "bfloat16", "float64"])
def test_masked_mean_and_aggregate_loss_mask_dtypes(kind):
    """mask.float() (0.0 / 1.0), integer and bool masks give the same results."""
    loss, keep = _loss_and_keep()
    _check_all(loss, keep.to(getattr(torch, kind)))
    ref = [torch_fused.aggregate_loss(loss, keep, mode) for mode in AGG_MODES]
    torch.testing.assert_close([torch_fused.aggregate_loss(loss, keep.to(getattr(torch, kind)), mode)
                                for mode in AGG_MODES], ref, **TOL)


def test_integer_mask_keeps_at_weight_one():
    """A bool or integer mask keeps its nonzero entries at weight 1: an integer 3 (or -2) counts
    once, as the bool mask mask != 0 does."""
    loss, keep = _loss_and_keep(8)
    g = torch.Generator().manual_seed(9)
    mask = torch.where(keep, torch.tensor([3, -2, 1])[torch.randint(0, 3, keep.shape, generator=g)], 0)
    assert bool((mask.abs() > 1).any())
    for m in (mask, mask.to(torch.int32)):
        for mode in AGG_MODES:
            torch.testing.assert_close(torch_fused.aggregate_loss(loss, m, mode),
                                       torch_fused.aggregate_loss(loss, keep, mode), rtol=0, atol=0)
        torch.testing.assert_close(torch_fused.masked_mean(loss, m, 1), torch_fused.masked_mean(loss, keep, 1),
                                   rtol=0, atol=0)
    _check_all(loss, mask)


def test_non_binary_float_mask_weighs():
    """A float mask weighs, as (loss * mask).sum() / mask.sum() does: 0.5 counts half, 2 twice, a
    negative weight subtracts; 0.0 and -0.0 drop their token. A row whose weights sum below 1
    (a lone 0.5) is divided by that sum, not by 1."""
    loss, keep = _loss_and_keep(1)
    vals = torch.tensor([0.5, -1.0, 2.0, 0.25, 3.0])
    g = torch.Generator().manual_seed(2)
    mask = torch.where(keep, vals[torch.randint(0, 5, keep.shape, generator=g)], torch.zeros(()))
    mask[1, 1] = -0.0
    mask[3] = 0.0
    mask[3, 2] = 0.5  # W_3 = 0.5
    _check_all(loss, mask)
    lo, m = loss.double(), mask.double()
    plain = (lo * m).sum() / m.sum()
    torch.testing.assert_close(torch_fused.aggregate_loss(loss, mask, "token-mean").double(), plain, **TOL)
    torch.testing.assert_close(torch_fused.masked_mean(loss, mask).double(), plain, **TOL)
    torch.testing.assert_close(torch_fused.masked_mean(loss, mask, 1)[3], loss[3, 2])


def test_nan_weight_gives_nan_and_zero_weights_are_not_read():
    """A NaN weight gives NaN where it counts, as the plain formula; a NaN or inf loss where the
    weight is 0 never reaches the result (the plain formula would give NaN there)."""
    loss, keep = _loss_and_keep(6)
    mask = keep.float() * 0.5
    mask[1, 2] = float("nan")
    assert torch_fused.masked_mean(loss, mask).isnan().item()
    row = torch_fused.masked_mean(loss, mask, 1)
    assert row.isnan().tolist() == [False, True, False, False]
    for mode in AGG_MODES:
        assert torch_fused.aggregate_loss(loss, mask, mode).isnan().item(), mode
    mask[1, 2] = 0.0
    bad = loss.clone()
    bad[~(mask != 0)] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(24)[: int((mask == 0).sum())]
    for mode in AGG_MODES:
        torch.testing.assert_close(torch_fused.aggregate_loss(bad, mask, mode),
                                   torch_fused.aggregate_loss(loss, mask, mode))
    torch.testing.assert_close(torch_fused.masked_mean(bad, mask, 1), torch_fused.masked_mean(loss, mask, 1))


def test_broadcast_float_mask_is_read_from_its_stored_elements():
    """A [B, 1] float mask weighs whole rows, expanded or broadcast by shape."""
    loss, _ = _loss_and_keep(3)
    row = torch.tensor([[1.0], [0.0], [0.5], [2.0]])  # [B, 1], expanded over L
    _check_all(loss, row.expand(4, 6))
    _check_all(loss, row)  # broadcast by shape
    col = torch.tensor([0.5, 0.0, 1.0, -0.25, 2.0, 1.0])  # [L]
    _check_all(loss, col)
    _check_all(loss, col.expand(4, 6))


def test_masked_mean_over_other_dims_and_scalars():
    g = torch.Generator().manual_seed(4)
    v = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    m = (torch.rand(3, 4, 1, generator=g) > 0.3) * torch.rand(3, 4, 1, generator=g, dtype=torch.float64) * 2
    w = m.expand(3, 4, 5)
    out = torch_fused.masked_mean(v, m, dim=1)
    assert out.dtype == torch.float64
    for d in (0, 1, 2):
        torch.testing.assert_close(torch_fused.masked_mean(v, m, dim=d), _div((v * w).sum(d), w.sum(d)),
                                   rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch_fused.masked_mean(v, m), (v * w).sum() / w.sum(), rtol=1e-12, atol=1e-12)
    assert torch_fused.masked_mean(torch.tensor(2.0), torch.tensor(0.5)).item() == 2.0
    assert torch_fused.masked_mean(torch.tensor(2.0), torch.tensor(0.0)).item() == 0.0
    assert torch_fused.masked_mean(torch.tensor([2.0, 4.0]), torch.tensor([0.25, 0.75])).item() == 3.5


def test_zero_weight_sums_give_zero_not_nan():
    """Where the weights sum to 0, an all-zero mask or weights that cancel, the means are 0
    (never NaN or inf) and seq-mean-token-mean leaves the row out."""
    loss, _ = _loss_and_keep()
    for mask in (torch.zeros(4, 6, dtype=torch.bool), torch.zeros(4, 6)):
        for mode in AGG_MODES:
            assert torch_fused.aggregate_loss(loss, mask, mode).item() == 0
        assert torch_fused.masked_mean(loss, mask).item() == 0
    cancel = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0]).repeat(4, 1)
    assert torch_fused.aggregate_loss(loss, cancel, "token-mean").item() == 0
    assert torch_fused.aggregate_loss(loss, cancel, "seq-mean-token-mean").item() == 0
    assert torch_fused.masked_mean(loss, cancel).item() == 0
    assert torch_fused.masked_mean(loss, cancel, 1).tolist() == [0.0] * 4
    cancel[0] = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.0])  # one row with W_b = 0.5
    torch.testing.assert_close(torch_fused.aggregate_loss(loss, cancel, "seq-mean-token-mean"), loss[0, 1])
    s, n = _expected(loss, cancel)
    torch.testing.assert_close(torch_fused.aggregate_loss(loss, cancel, "seq-mean-token-sum").double(),
                               s.mean(), **TOL)  # the cancelling rows' S_b still count here


def test_aggregate_loss_float_mask_compiled():
    """A GRPO step's call form, mask.float(), inside torch.compile(fullgraph=True)."""
    loss, keep = _loss_and_keep(5)
    f = torch.compile(lambda l, m: torch_fused.aggregate_loss(l, m, "seq-mean-token-mean"), fullgraph=True,
                      backend="aot_eager")
    torch._dynamo.reset()
    s, n = _expected(loss, keep)
    rows = n > 0
    torch.testing.assert_close(f(loss, keep.float()).double(), (s[rows] / n[rows]).mean(), **TOL)


def test_mask_weight_op_check():
    """fused::_mask_weight (the helpers' denominators): its fake, autograd and compile
    registrations agree with its implementation, broadcast masks and both output dtypes."""
    g = torch.Generator().manual_seed(10)
    w = torch.rand(4, 1, generator=g)
    for mask, dtype in ((w.expand(4, 6), torch.float32), (w.double(), torch.float64),
                        (torch.rand(6, generator=g) > 0.5, torch.float64), (w.expand(4, 6).bfloat16(), torch.float32)):
        for dim in (0, 1):
            torch.library.opcheck(torch.ops.fused._mask_weight, (mask, [4, 6], dim, dtype))
            out = torch.ops.fused._mask_weight(mask, [4, 6], dim, dtype)
            assert out.dtype == dtype
            torch.testing.assert_close(out.double(), _weights_of(mask, (4, 6)).sum(dim))


def _plain_call(fn_arg, x, w):
    """The float64 plain formula of a helper call (("agg", mode) or ("mean", dim)) on values x and
    weights w (both [B, L]), with a safe 0 where a weight sum is 0; differentiable in x."""
    name, arg = fn_arg
    if name == "mean":
        return _div((x * w).sum(), w.sum()) if arg is None else _div((x * w).sum(arg), w.sum(arg))
    s, n = (x * w).sum(1), w.sum(1)
    if arg == "token-mean":
        return _div(s.sum(), n.sum())
    if arg == "seq-mean-token-mean":
        return _div(_div(s, n).sum(), (n != 0).sum().to(s.dtype))
    if arg == "seq-mean-token-sum":
        return s.sum() / max(x.shape[0], 1)
    return s.sum() / max(x.shape[1], 1)


FNS = [("agg", m) for m in AGG_MODES] + [("mean", None), ("mean", 0), ("mean", 1), ("mean", -1)]


def _call(fn_arg):
    name, arg = fn_arg
    if name == "agg":
        return lambda x, m: torch_fused.aggregate_loss(x, m, arg)
    return lambda x, m: torch_fused.masked_mean(x, m, arg)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_mask_that_requires_grad_gets_no_gradient(mode):
    """A floating mask made by differentiable code (it requires grad): the helpers differentiate
    the values only, as mask_reduce does; the mask, which weighs, gets no gradient (where the
    backward once raised for want of an autograd formula of the denominator, and the compiled
    call failed to compile). The values' gradient is the plain formula's, w / W."""
    loss, keep = _loss_and_keep(7)
    weights = keep.double() * torch.tensor([0.5, 2.0, 1.0, -0.25, 1.0, 3.0], dtype=torch.float64)
    weights[3] = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])  # a row whose weights cancel
    w = torch.randn(loss.shape)
    for fn_arg in FNS:
        fn = _call(fn_arg)
        v = loss.detach().double().requires_grad_(True)
        m = weights.clone().requires_grad_(True)
        f = fn
        if mode == "compiled":
            torch._dynamo.reset()
            f = torch.compile(fn, fullgraph=True, backend="aot_eager")
        out = f(v, m)
        dv, dm = torch.autograd.grad((out * w[0, : out.numel()].reshape(out.shape)).sum(), (v, m), allow_unused=True)
        v2 = loss.detach().double().requires_grad_(True)
        ref = _plain_call(fn_arg, v2, weights)
        (rdv,) = torch.autograd.grad((ref * w[0, : ref.numel()].reshape(ref.shape)).sum(), v2)
        torch.testing.assert_close(out, ref.detach())
        torch.testing.assert_close(dv, rdv)
        assert dm is None
        assert torch.equal(out, fn(loss.double(), weights))  # the same call with a mask that does not require grad


AGG = torch_fused.aggregate_loss
MEAN = torch_fused.masked_mean
BAD = [  # (id, function, args, message)
    ("loss dtype", AGG, (torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4)),
     r"loss: expected dtype float16, bfloat16, float32 or float64, got torch.int64"),
    ("loss rank", AGG, (torch.zeros(4), torch.ones(4)), r"loss: expected a \[B, L\] tensor, got shape \(4,\)"),
    ("mask shape", AGG, (torch.zeros(3, 4), torch.ones(3, 5)),
     r"mask: shape \(3, 5\) does not broadcast to loss of shape \(3, 4\)"),
    ("mask dtype", AGG, (torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.complex64)),
     r"mask: expected a bool, integer or floating dtype, got torch.complex64"),
    ("mode", AGG, (torch.zeros(3, 4), torch.ones(3, 4), "mean"), r"mode: expected one of \('token-mean'.*got 'mean'"),
    ("values dtype", MEAN, (torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, 4)),
     r"values: expected dtype float16, bfloat16, float32 or float64, got torch.int32"),
    ("values dim", MEAN, (torch.zeros(3, 4), torch.ones(3, 4), 2),
     r"dim: expected a dim of values in \[-2, 2\), got 2"),
    ("values mask shape", MEAN, (torch.zeros(3, 4), torch.ones(2, 4)),
     r"mask: shape \(2, 4\) does not broadcast to values of shape \(3, 4\)"),
]


@pytest.mark.parametrize("fn,args,msg", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_errors_name_the_callers_arguments(fn, args, msg, mode):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    rest = args[len(tensors):]
    f = lambda *t: fn(*t, *rest)  # noqa: E731
    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=msg):
        f(*tensors)


# ---------------------------------------------------------------------------------------------
# The helpers under torch.compile(fullgraph=True) with Inductor (the backend users run), against
# the float64 plain formula: mask dtypes, float weights (negative ones too), broadcast shapes,
# views made inside and outside the graph, size-0 dims, every aggregation mode and masked_mean
# over every dim. A compiled graph lays out the tensors it makes as it likes; the helpers must
# never depend on their strides.
# ---------------------------------------------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

MASK_KINDS = ["bool", "int32", "uint8", "float32", "bfloat16", "float64"]
# (name, shape of the stored mask given B and L, how the mask reaches the helper)
MASK_FORMS = ["full", "[B,1]", "[1,L]", "[L]", "[B,1] expanded", "[L] expanded", "[B,1] expanded in graph",
              "[L] expanded in graph", "full transposed"]
# float mask weights: dyadic values, so that every weight sum is exact in float32 (a sum that
# cancels to 0 does so in both precisions), negative ones included
WEIGHTS = [1.0, 0.5, -2.0, 2.0, 0.25, 3.0]


def _mask_for(form, b, l, kind, g):
    shape = {"[B,1]": (b, 1), "[1,L]": (1, l), "[L]": (l,)}.get(form.split(" ")[0], (b, l))
    if form == "full transposed":
        keep = (torch.rand(l, b, generator=g) > 0.4).t()
    else:
        keep = torch.rand(shape, generator=g) > 0.4
    vals = torch.tensor(WEIGHTS)[torch.randint(0, len(WEIGHTS), keep.shape, generator=g)]
    if kind == "bool":
        m = keep
    elif kind.startswith("float") or kind == "bfloat16":
        m = torch.where(keep, vals, torch.zeros(())).to(getattr(torch, kind))
    else:
        m = torch.where(keep, torch.randint(1, 5, keep.shape, generator=g), 0).to(getattr(torch, kind))
    if form == "full transposed":
        m = m.t().contiguous().t()  # a non-contiguous [B, L] input
    if form in ("[B,1] expanded", "[L] expanded"):
        m = m.expand(b, l)
    return m


def _truth(fn, arg, loss, mask):
    """float64 result of the plain formula (loss * w).sum(dim) / w.sum(dim) (0 where a weight sum
    is 0), w the weights of mask (a floating mask's values; mask != 0 of a bool or integer one)."""
    return _plain_call((fn, arg), loss.double(), _weights_of(mask, loss.shape))


def _assert_matches(out, fn, arg, loss, mask):
    """out against _truth, to float32 accumulation: the error bound is the same formula on |loss|
    and |w| with the real denominators' magnitudes (weights that nearly cancel amplify the
    numerator's rounding; their sums are exact, see WEIGHTS)."""
    truth = _truth(fn, arg, loss, mask)
    w = _weights_of(mask, loss.shape)
    x = loss.double()
    if fn == "mean":
        num = (x.abs() * w.abs()).sum() if arg is None else (x.abs() * w.abs()).sum(arg)
        den = w.sum() if arg is None else w.sum(arg)
        mag = _div(num, den.abs())
    elif arg == "token-mean":
        mag = _div((x.abs() * w.abs()).sum(), w.sum().abs())
    elif arg == "seq-mean-token-mean":
        n = w.sum(1)
        mag = _div(_div((x.abs() * w.abs()).sum(1), n.abs()).sum(), (n != 0).sum().double())
    else:
        mag = _plain_call((fn, arg), x.abs(), w.abs())
    assert out.shape == truth.shape
    err = (out.double() - truth).abs()
    assert bool((err <= 1e-5 * mag + 1e-6).all()), (out, truth)


# Each example compiles its own graph. The plain run sweeps the mask kinds, forms and helpers (the
# helpers' own code); the interpreter run (the same helpers, with mask_reduce's kernels inside the
# compiled graph, whose mask strides and forms test_mask_reduce.py sweeps) takes fewer examples.
@settings(max_examples=8 if INTERPRET else 30)
@given(b=st.integers(0, 4), l=st.integers(0, 6), kind=st.sampled_from(MASK_KINDS),
       form=st.sampled_from(MASK_FORMS), fn=st.sampled_from(FNS), seed=st.integers(0, 2**16))
def test_helpers_compiled_with_inductor_match_float64(b, l, kind, form, fn, seed):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, l, generator=g)
    mask = _mask_for(form, b, l, kind, g)
    name, arg = fn
    in_graph = form.endswith("in graph")

    def f(x, m):
        if in_graph:
            m = m.expand(b, l) if m.dim() == 2 else m[None].expand(b, l)
        if name == "agg":
            return torch_fused.aggregate_loss(x, m, arg)
        return torch_fused.masked_mean(x, m, arg)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True)(loss, mask)
    _assert_matches(out, name, arg, loss, mask)
    _assert_matches(f(loss, mask), name, arg, loss, mask)  # eager


@pytest.mark.parametrize("form", ["full", "[B,1] expanded in graph", "[L]", "full transposed"])
def test_float_weights_compiled_dynamic_match_the_plain_formula(form):
    """Float weights (0.5, 2, -2, ...) through every helper in one torch.compile(fullgraph=True,
    dynamic=True) graph with Inductor, over three sequence lengths without a recompile: values
    and the loss's gradient against the float64 plain formula, eager and compiled."""
    in_graph = form.endswith("in graph")

    def f(x, m):
        if in_graph:
            m = m.expand(x.shape[0], x.shape[1])
        return tuple(_call(fn_arg)(x, m) for fn_arg in FNS)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(12)
    w_out = [torch.randn(16, generator=g, dtype=torch.float64) for _ in FNS]
    torch._dynamo.utils.counters.clear()
    for l in (5, 7, 9):
        loss = torch.randn(4, l, generator=g)
        mask = _mask_for(form.replace(" in graph", ""), 4, l, "float32", g)
        if in_graph:
            mask = mask[:, :1].contiguous()  # the stored [B, 1] mask, expanded inside the graph
        w = _weights_of(mask, loss.shape)
        x64 = loss.double().requires_grad_(True)
        truths = [_plain_call(fn_arg, x64, w) for fn_arg in FNS]
        (rgrad,) = torch.autograd.grad(sum((t * c[: t.numel()].reshape(t.shape)).sum() for t, c in zip(truths, w_out)),
                                       x64)
        for run in (compiled, f):
            x = loss.clone().requires_grad_(True)
            outs = run(x, mask)
            for fn_arg, out in zip(FNS, outs):
                _assert_matches(out.detach(), *fn_arg, loss, mask)
            (grad,) = torch.autograd.grad(sum((o.double() * c[: o.numel()].reshape(o.shape)).sum()
                                              for o, c in zip(outs, w_out)), x)
            torch.testing.assert_close(grad.double(), rgrad, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])


def test_reported_compiled_broadcast_float_masks():
    """The two reported cases: a [B, 1] float mask through token-mean, an [L] float mask through
    masked_mean over dim 0, compiled with Inductor (it gave 0.0276 for 0.0368, and 56 for 14)."""
    torch._dynamo.reset()
    loss = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    got = torch.compile(lambda x, m: torch_fused.aggregate_loss(x, m, "token-mean"), fullgraph=True)(loss, mask)
    torch.testing.assert_close(got.double(), _truth("agg", "token-mean", loss, mask))
    v = torch.arange(24.0).reshape(4, 6)
    m = torch.tensor([1.0, 0, 1, 1, 0, 1])
    got = torch.compile(lambda x, m: torch_fused.masked_mean(x, m, 0), fullgraph=True)(v, m)
    torch.testing.assert_close(got, torch.tensor([9.0, 0.0, 11.0, 12.0, 0.0, 14.0]))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_empty_stride0_mask(mode):
    """An empty float mask with a stride-0 dim: no out-of-bounds view (it crashed the process
    under compile), the documented 0 result."""
    f = lambda x, m: torch_fused.aggregate_loss(x, m, "token-mean")  # noqa: E731
    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True)
    assert f(torch.randn(2, 0), torch.ones(2, 1).expand(2, 0)).item() == 0.0
    assert torch_fused.masked_mean(torch.randn(0, 3), torch.ones(1, 3).expand(0, 3), 0).tolist() == [0.0] * 3


def test_masked_mean_dim_changing_between_compiled_calls():
    """dim is an int that changes between calls: Dynamo makes it dynamic after the first change;
    the check on it must still compile (it failed on torch._check's message closure)."""
    torch._dynamo.reset()
    v = torch.arange(24.0).reshape(4, 6)
    m = torch.tensor([1.0, 0, 1, 1, 0, 1]).expand(4, 6)
    f = torch.compile(lambda x, m, d: torch_fused.masked_mean(x, m, d), fullgraph=True, backend="aot_eager")
    for d in (0, 1, -1, 0, -2):
        torch.testing.assert_close(f(v, m, d).double(), _truth("mean", d, v, m))
    with pytest.raises(Exception, match=r"dim: expected a dim of values in \[-2, 2\), got 5"):
        f(v, m, 5)
