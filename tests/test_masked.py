"""The helpers of torch_fused.masked: the cost model, masked_mean and aggregate_loss (bool,
integer and float masks; errors that name the caller's arguments, eager and compiled)."""

from __future__ import annotations

import pytest
import torch

import torch_fused
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


def _expected(loss, keep):
    """float64 per-row sums S_b and counts N_b over the kept tokens (keep: a bool [B, L])."""
    k = keep.double()
    return (loss.double() * k).sum(1), k.sum(1)


def _check_all(loss, mask, keep):
    """masked_mean and every aggregate_loss mode on (loss, mask) against the formulas on keep."""
    s, n = _expected(loss, keep)
    torch.testing.assert_close(torch_fused.masked_mean(loss, mask).double(), s.sum() / n.sum(), **TOL)
    mm = torch_fused.masked_mean(loss, mask, dim=1).double()
    rows = n > 0
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
    _check_all(loss, keep.to(getattr(torch, kind)), keep)


def test_non_binary_float_mask_keeps_every_nonzero_entry():
    """A float mask selects (mask != 0), it never weights: 0.5, -1, 2 and NaN keep their token
    with weight 1, 0.0 and -0.0 drop it."""
    loss, keep = _loss_and_keep(1)
    vals = torch.tensor([0.5, -1.0, 2.0, float("nan"), 0.25])
    g = torch.Generator().manual_seed(2)
    mask = torch.where(keep, vals[torch.randint(0, 5, keep.shape, generator=g)], torch.zeros(()))
    mask[1, 1] = -0.0
    keep[1, 1] = False
    assert bool(((mask != 0) == keep).all()) and bool(mask.isnan().any())
    _check_all(loss, mask, keep)


def test_broadcast_float_mask_is_read_from_its_stored_elements():
    loss, _ = _loss_and_keep(3)
    row = torch.tensor([[1.0], [0.0], [0.5], [1.0]])  # [B, 1], expanded over L
    keep = (row != 0).expand(4, 6)
    _check_all(loss, row.expand(4, 6), keep)
    _check_all(loss, row, keep)  # broadcast by shape


def test_masked_mean_over_other_dims_and_scalars():
    g = torch.Generator().manual_seed(4)
    v = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    m = (torch.rand(3, 4, 1, generator=g) > 0.3).float()
    keep = (m != 0).expand(3, 4, 5).double()
    out = torch_fused.masked_mean(v, m, dim=1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, (v * keep).sum(1) / keep.sum(1).clamp_min(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch_fused.masked_mean(v, m), (v * keep).sum() / keep.sum(), rtol=1e-12, atol=1e-12)
    assert torch_fused.masked_mean(torch.tensor(2.0), torch.tensor(0.5)).item() == 2.0
    assert torch_fused.masked_mean(torch.tensor(2.0), torch.tensor(0.0)).item() == 0.0


def test_all_zero_mask_gives_zero_not_nan():
    loss, _ = _loss_and_keep()
    for mask in (torch.zeros(4, 6, dtype=torch.bool), torch.zeros(4, 6)):
        for mode in AGG_MODES:
            assert torch_fused.aggregate_loss(loss, mask, mode).item() == 0
        assert torch_fused.masked_mean(loss, mask).item() == 0


def test_aggregate_loss_float_mask_compiled():
    """A GRPO step's call form, mask.float(), inside torch.compile(fullgraph=True)."""
    loss, keep = _loss_and_keep(5)
    f = torch.compile(lambda l, m: torch_fused.aggregate_loss(l, m, "seq-mean-token-mean"), fullgraph=True,
                      backend="aot_eager")
    torch._dynamo.reset()
    s, n = _expected(loss, keep)
    rows = n > 0
    torch.testing.assert_close(f(loss, keep.float()).double(), (s[rows] / n[rows]).mean(), **TOL)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_mask_that_requires_grad_gets_no_gradient(mode):
    """A floating mask made by differentiable code (it requires grad): the helpers differentiate
    the values only, as mask_reduce does; the mask, which selects, gets no gradient (the kept
    count is not differentiable), where the backward once raised for want of an autograd formula
    of the count, and the compiled call failed to compile."""
    loss, keep = _loss_and_keep(7)
    w = torch.randn(loss.shape)
    calls = [lambda v, m: torch_fused.masked_mean(v, m, 1), lambda v, m: torch_fused.masked_mean(v, m)]
    calls += [lambda v, m, a=a: torch_fused.aggregate_loss(v, m, a) for a in AGG_MODES]
    for fn in calls:
        v = loss.detach().double().requires_grad_(True)
        m = keep.double().requires_grad_(True)
        f = fn
        if mode == "compiled":
            torch._dynamo.reset()
            f = torch.compile(fn, fullgraph=True, backend="aot_eager")
        out = f(v, m)
        dv, dm = torch.autograd.grad((out * w[0, : out.numel()].reshape(out.shape)).sum(), (v, m), allow_unused=True)
        v2 = loss.detach().double().requires_grad_(True)
        ref = fn(v2, keep.double())  # the same call with a mask that does not require grad
        (rdv,) = torch.autograd.grad((ref * w[0, : ref.numel()].reshape(ref.shape)).sum(), v2)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(dv, rdv)
        assert dm is None


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
# float64 formulas: mask dtypes, broadcast shapes, views made inside and outside the graph, size-0
# dims, every aggregation mode and masked_mean over every dim. A compiled graph lays out the
# tensors it makes as it likes; the helpers must never depend on their strides.
# ---------------------------------------------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

MASK_KINDS = ["bool", "int32", "uint8", "float32", "bfloat16", "float64"]
# (name, shape of the stored mask given B and L, how the mask reaches the helper)
MASK_FORMS = ["full", "[B,1]", "[1,L]", "[L]", "[B,1] expanded", "[L] expanded", "[B,1] expanded in graph",
              "[L] expanded in graph", "full transposed"]
FNS = [("agg", m) for m in AGG_MODES] + [("mean", None), ("mean", 0), ("mean", 1), ("mean", -1)]


def _mask_for(form, b, l, kind, g):
    shape = {"[B,1]": (b, 1), "[1,L]": (1, l), "[L]": (l,)}.get(form.split(" ")[0], (b, l))
    if form == "full transposed":
        keep = (torch.rand(l, b, generator=g) > 0.4).t()
    else:
        keep = torch.rand(shape, generator=g) > 0.4
    vals = torch.tensor([1.0, 0.5, -2.0, float("nan")])[torch.randint(0, 4, keep.shape, generator=g)]
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
    """float64 result of the helper's documented formula on keep = broadcast(mask) != 0."""
    keep = (torch.broadcast_to(mask, loss.shape) != 0).double()
    v = loss.double() * keep
    if fn == "mean":
        if arg is None:
            return v.sum() / keep.sum().clamp_min(1)
        return v.sum(arg) / keep.sum(arg).clamp_min(1)
    s, n = v.sum(1), keep.sum(1)
    if arg == "token-mean":
        return s.sum() / n.sum().clamp_min(1)
    if arg == "seq-mean-token-mean":
        rows = n > 0
        return (s[rows] / n[rows]).sum() / rows.sum().clamp_min(1)
    if arg == "seq-mean-token-sum":
        return s.sum() / max(loss.shape[0], 1)
    return s.sum() / max(loss.shape[1], 1)


@settings(max_examples=30)
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
    truth = _truth(name, arg, loss, torch.broadcast_to(mask, loss.shape))
    torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f(loss, mask).double(), truth, rtol=1e-5, atol=1e-6)  # eager


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
