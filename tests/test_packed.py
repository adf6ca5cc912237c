"""Packed batches: sequences laid end to end in one row ``[1, T]`` with ``cu_seqlens`` (int32
``[S+1]``, FlashAttention's convention). masked_mean, aggregate_loss (every mode) and mask_reduce
with ``cu_seqlens=`` against the padded ``[S, L_max]`` layout of the same data and against the
float64 plain formula per sequence (float weights, empty sequences, gradients), compiled with
``dynamic=True`` without a recompile as S and T change, errors that name ``cu_seqlens`` and
``norm_len``; and the log-prob ops on a packed row through ``packed_targets``, equal to scoring
each sequence alone with ``shift=True``, with no gradient across a boundary."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import torch_fused
from torch_fused._library import INTERPRET
from torch_fused.masked import AGG_MODES

# dyadic weights (negative ones too): every weight sum is exact in float32, so a float32 result
# and the float64 reference differ by the numerators' rounding only
WEIGHTS = [1.0, 0.5, -2.0, 2.0, 0.25, 3.0]
MASK_KINDS = ["bool", "int32", "float32", "bfloat16", "float64"]
BACKEND = "aot_eager" if INTERPRET else "inductor"  # the interpreted kernels: one program at a time


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=dtype)


def _data(lengths, seed, kind="bool", dtype=torch.float32):
    """A packed row of S = len(lengths) sequences and the padded layout of the same data: loss
    [T] (NaN in the padding of loss_pad, which no helper may read), a mask of ``kind`` (float
    kinds weigh with WEIGHTS), cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    cu = _cu(lengths)
    t, lmax = sum(lengths), max(lengths, default=0)
    loss = torch.randn(t, generator=g).to(dtype)
    keep = torch.rand(t, generator=g) > 0.3
    if kind == "bool":
        mask = keep
    elif kind.startswith("int"):
        mask = torch.where(keep, torch.randint(1, 4, (t,), generator=g), 0).to(getattr(torch, kind))
    else:
        vals = torch.tensor(WEIGHTS)[torch.randint(0, len(WEIGHTS), (t,), generator=g)]
        mask = torch.where(keep, vals, torch.zeros(())).to(getattr(torch, kind))
    loss_pad = torch.full((len(lengths), lmax), float("nan"), dtype=dtype)
    mask_pad = torch.zeros((len(lengths), lmax), dtype=mask.dtype)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        loss_pad[s, : b - a] = loss[a:b]
        mask_pad[s, : b - a] = mask[a:b]
    return dict(cu=cu, loss=loss, mask=mask, loss_pad=loss_pad, mask_pad=mask_pad, lengths=list(lengths), lmax=lmax)


def _weights(mask):
    return mask.double() if mask.is_floating_point() else (mask != 0).double()


def _div(num, den):
    return num / den if den != 0 else 0.0


def _reference(d, fn, norm_len=None, absolute=False):
    """float64 plain formula per sequence, from the packed data and python loops (an independent
    route from both layouts). ``absolute``: the same formula on |loss| and |w| with |W|
    denominators, the scale of the rounding error of a float32 result."""
    x, w = d["loss"].double(), _weights(d["mask"])
    if absolute:
        x, w = x.abs(), w.abs()
    cu = d["cu"].tolist()
    sums = [float((x[a:b] * w[a:b]).sum()) for a, b in zip(cu[:-1], cu[1:])]
    wsum = [float(_weights(d["mask"])[a:b].sum()) for a, b in zip(cu[:-1], cu[1:])]
    if absolute:
        wsum = [abs(v) for v in wsum]
    n = len(sums)
    if fn == "token-mean":
        den = sum(_weights(d["mask"]).tolist())
        return torch.tensor(_div(sum(sums), abs(den) if absolute else den), dtype=torch.float64)
    if fn == "seq-mean-token-mean":
        kept = [_div(s, v) for s, v in zip(sums, wsum) if v != 0]
        return torch.tensor(_div(sum(kept), len(kept)), dtype=torch.float64)
    if fn == "seq-mean-token-sum":
        return torch.tensor(sum(sums) / max(n, 1), dtype=torch.float64)
    if fn == "seq-mean-token-sum-norm":
        return torch.tensor(sum(sums) / norm_len, dtype=torch.float64)
    if fn == "mean":  # per sequence
        return torch.tensor([_div(s, v) for s, v in zip(sums, wsum)], dtype=torch.float64)
    if fn == "sum":  # per sequence
        return torch.tensor(sums, dtype=torch.float64)
    raise AssertionError(fn)


def _assert_matches(out, d, fn, norm_len=None, what=""):
    truth = _reference(d, fn, norm_len)
    bound = 1e-5 * _reference(d, fn, norm_len, absolute=True) + 1e-6
    assert out.shape == truth.shape, (what, out.shape, truth.shape)
    err = (out.double() - truth).abs()
    assert bool((err <= bound).all()), (what, out, truth)


def _norm_len(d):
    return max(d["lmax"], 1)


def _agg_kwargs(mode, d):
    return dict(norm_len=_norm_len(d)) if mode == "seq-mean-token-sum-norm" else {}


@settings(max_examples=8 if INTERPRET else 25)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5), kind=st.sampled_from(MASK_KINDS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), row=st.booleans(),
       mask_1d=st.booleans(), cu64=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_equals_padded_and_float64(lengths, kind, dtype, row, mask_1d, cu64, seed):
    """Every aggregate_loss mode, masked_mean per sequence and overall, and mask_reduce per
    sequence on the packed row ([1, T] or [T]; a [T] mask broadcast to [1, T]; int32 or int64
    cu_seqlens) equal the padded layout's results and the float64 formula, empty sequences
    (repeated cu_seqlens values) and all-masked ones included."""
    d = _data(lengths, seed, kind, dtype)
    cu = d["cu"].long() if cu64 else d["cu"]
    loss = d["loss"][None] if row else d["loss"]
    mask = d["mask"] if (mask_1d or not row) else d["mask"][None]
    lo_pad, m_pad = d["loss_pad"], d["mask_pad"]
    for mode in AGG_MODES:
        packed = torch_fused.aggregate_loss(loss, mask, mode, cu_seqlens=cu, **_agg_kwargs(mode, d))
        padded = torch_fused.aggregate_loss(lo_pad, m_pad, mode, **_agg_kwargs(mode, d))
        assert packed.dtype == padded.dtype and packed.shape == ()
        _assert_matches(packed, d, mode, _norm_len(d), mode)
        _assert_matches(padded, d, mode, _norm_len(d), mode)
    s = len(lengths)
    means = torch_fused.masked_mean(loss, mask, loss.dim() - 1, cu_seqlens=cu)
    assert means.shape == ((1, s) if row else (s,))
    _assert_matches(means.reshape(s), d, "mean", what="masked_mean")
    torch.testing.assert_close(means.reshape(s), torch_fused.masked_mean(lo_pad, m_pad, 1), rtol=1e-5, atol=1e-6)
    _assert_matches(torch_fused.masked_mean(loss, mask, cu_seqlens=cu), d, "token-mean", what="masked_mean all")
    # mask_reduce: the mask selects, the scale weighs
    scale = _weights(d["mask"]).to(torch.float64 if dtype == torch.float64 else torch.float32)
    sums = torch_fused.mask_reduce(loss, -1, mask, scale if not row else scale[None], cu_seqlens=cu,
                                   out_dtype=torch.float64)
    assert sums.shape == ((1, s) if row else (s,))
    _assert_matches(sums.reshape(s), d, "sum", what="mask_reduce")
    pad_scale = _weights(m_pad).to(scale.dtype)
    torch.testing.assert_close(sums.reshape(s), torch_fused.mask_reduce(lo_pad, 1, m_pad, pad_scale,
                                                                        out_dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert torch_fused.mask_reduce(loss, -1, mask, cu_seqlens=cu).dtype == dtype  # out_dtype: x's


LENGTHS = [3, 0, 5, 1, 0, 4]  # empty sequences in the middle and at the end of a run of values


def _fns(d):
    """(name, packed call, padded call) for every helper, on differentiable loss tensors."""
    cu, m, m_pad = d["cu"], d["mask"][None], d["mask_pad"]
    out = [(mode, lambda x, mode=mode: torch_fused.aggregate_loss(x, m, mode, cu_seqlens=cu, **_agg_kwargs(mode, d)),
            lambda x, mode=mode: torch_fused.aggregate_loss(x, m_pad, mode, **_agg_kwargs(mode, d)))
           for mode in AGG_MODES]
    out.append(("masked_mean", lambda x: torch_fused.masked_mean(x, m, 1, cu_seqlens=cu)[0],
                lambda x: torch_fused.masked_mean(x, m_pad, 1)))
    w, w_pad = _weights(d["mask"])[None], _weights(m_pad)
    out.append(("mask_reduce", lambda x: torch_fused.mask_reduce(x, 1, m != 0, w, cu_seqlens=cu)[0],
                lambda x: torch_fused.mask_reduce(x, 1, m_pad != 0, w_pad)))
    return out


@pytest.mark.parametrize("kind", ["bool", "float64"])
def test_gradients_equal_the_padded_layouts(kind):
    """float64: the loss's gradient on the packed row is the padded layout's gradient at the same
    tokens (and 0 where the weight is 0); the mask gets none."""
    d = _data(LENGTHS, 1, kind, torch.float64)
    cu = d["cu"]
    for name, packed, padded in _fns(d):
        x = d["loss"][None].clone().requires_grad_(True)
        xp = torch.nan_to_num(d["loss_pad"]).requires_grad_(True)
        out, out_pad = packed(x), padded(xp)
        torch.testing.assert_close(out, out_pad, rtol=1e-12, atol=1e-12)
        c = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        (g,) = torch.autograd.grad((out * c).sum(), x)
        (gp,) = torch.autograd.grad((out_pad * c).sum(), xp)
        want = torch.cat([gp[s, : b - a] for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))])
        torch.testing.assert_close(g[0], want, rtol=1e-12, atol=1e-12, msg=name)
        assert bool((g[0][_weights(d["mask"]) == 0] == 0).all()), name
    if kind == "float64":
        m = d["mask"][None].clone().requires_grad_(True)
        x = d["loss"][None].clone().requires_grad_(True)
        out = torch_fused.aggregate_loss(x, m, "seq-mean-token-mean", cu_seqlens=cu)
        assert torch.autograd.grad(out, (x, m), allow_unused=True)[1] is None


def test_masked_tokens_are_never_read():
    """NaN and inf losses where the weight is 0 do not reach any result or gradient."""
    d = _data(LENGTHS, 3, "float32")
    bad = d["loss"].clone()
    off = d["mask"] == 0
    bad[off] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(len(bad))[: int(off.sum())]
    for name, packed, _ in _fns(d):
        x = bad[None].clone().requires_grad_(True)
        out = packed(x)
        torch.testing.assert_close(out, packed(d["loss"][None]), msg=name)
        (g,) = torch.autograd.grad(out.sum(), x)
        assert bool(g.isfinite().all()), name


def test_per_sequence_outputs_over_other_dims():
    """mask_reduce and masked_mean over a packed dim that is not the last: [1, T, H] features
    with a [1, T, 1] mask give [1, S, H], the padded layout's [S, H]."""
    g = torch.Generator().manual_seed(4)
    lengths = [2, 0, 3, 1]
    cu = _cu(lengths)
    x = torch.randn(1, 6, 3, generator=g, dtype=torch.float64)
    m = (torch.rand(1, 6, 1, generator=g) > 0.3).double() * 0.5
    sums = torch_fused.mask_reduce(x, 1, m, m, cu_seqlens=cu)
    means = torch_fused.masked_mean(x, m, 1, cu_seqlens=cu)
    assert sums.shape == means.shape == (1, 4, 3)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        num, den = (x[0, a:b] * m[0, a:b]).sum(0), m[0, a:b].sum()
        torch.testing.assert_close(sums[0, s], num)
        torch.testing.assert_close(means[0, s], num / den if den != 0 else torch.zeros(3, dtype=torch.float64))
    assert not means._is_view() and not sums._is_view()


def test_token_mean_and_the_global_mean_ignore_the_layout():
    """token-mean and masked_mean(dim=None) are the same with and without cu_seqlens (bitwise)."""
    d = _data(LENGTHS, 5, "float32")
    x, m = d["loss"][None], d["mask"][None]
    assert torch.equal(torch_fused.aggregate_loss(x, m, cu_seqlens=d["cu"]), torch_fused.aggregate_loss(x, m))
    assert torch.equal(torch_fused.masked_mean(x, m, cu_seqlens=d["cu"]), torch_fused.masked_mean(x, m))


def test_norm_len_without_cu_seqlens():
    """norm_len replaces the padded length L of seq-mean-token-sum-norm in the padded layout too;
    its default is L."""
    d = _data([3, 2], 6, "bool")
    lo, m = torch.nan_to_num(d["loss_pad"]), d["mask_pad"]
    mode = "seq-mean-token-sum-norm"
    torch.testing.assert_close(torch_fused.aggregate_loss(lo, m, mode, norm_len=3),
                               torch_fused.aggregate_loss(lo, m, mode))
    torch.testing.assert_close(torch_fused.aggregate_loss(lo, m, mode, norm_len=8.0) * 8,
                               torch_fused.aggregate_loss(lo, m, mode) * 3)


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True, dynamic=True): one graph for every S and T
# ---------------------------------------------------------------------------------------------

RUNS = [[3, 0, 4], [5, 2, 2, 1], [1, 6], [2, 3, 0, 0, 4, 1]]  # S = 3, 4, 2, 6; T = 7, 10, 7, 10
COMPILED = ["seq-mean-token-mean", "seq-mean-token-sum-norm", "masked_mean", "mask_reduce", "packed_targets"]


def _helpers(x, m, cu, n):
    return (torch_fused.aggregate_loss(x, m, "seq-mean-token-mean", cu_seqlens=cu),
            torch_fused.aggregate_loss(x, m, "seq-mean-token-sum-norm", cu_seqlens=cu, norm_len=n),
            torch_fused.masked_mean(x, m, 1, cu_seqlens=cu), torch_fused.mask_reduce(x, 1, m, m, cu_seqlens=cu),
            torch_fused.packed_targets(m != 0, cu, 0))


def test_compiled_dynamic_no_recompile_as_s_and_t_change():
    """The segment reductions (a per-sequence mean, a constant normalizer, per-sequence outputs)
    and packed_targets in one torch.compile(fullgraph=True, dynamic=True) graph with Inductor,
    over runs whose S, T and norm_len change: one graph (no recompile), values and gradients
    equal to eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(_helpers, fullgraph=True, dynamic=True, backend=BACKEND)
    for i, lengths in enumerate(RUNS):
        d = _data(lengths, 10 + i, "float32")
        n = _norm_len(d)
        outs = []
        grads = []
        for fn in (f, _helpers):
            x = d["loss"][None].clone().requires_grad_(True)
            out = fn(x, d["mask"][None], d["cu"], n)
            (g,) = torch.autograd.grad(sum(o.sum() * (k + 1) for k, o in enumerate(out[:-1])), x)
            outs.append(out)
            grads.append(g)
        for name, a, b in zip(COMPILED, *outs):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
        assert outs[0][-1].dtype == torch.bool
    stats = dict(torch._dynamo.utils.counters["stats"])
    assert stats["unique_graphs"] == 1, stats


def test_compiled_every_mode_one_sequence_and_many():
    """Every aggregate_loss mode compiled with dynamic=True, against the float64 formula, as S
    goes 3, 1, 4: aggregate_loss makes no [S] tensor (whose size 1 torch.compile would
    specialize), so a run with a single sequence shares the graph too."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(lambda x, m, cu, n: torch.stack([
        torch_fused.aggregate_loss(x, m, mode, cu_seqlens=cu, norm_len=n if mode.endswith("norm") else None)
        for mode in AGG_MODES]), fullgraph=True, dynamic=True, backend="aot_eager")
    for lengths in ([4, 0, 3], [6], [2, 5, 1, 1]):
        d = _data(lengths, 7, "float32")
        got = f(d["loss"][None], d["mask"][None], d["cu"], _norm_len(d))
        for mode, v in zip(AGG_MODES, got):
            _assert_matches(v, d, mode, _norm_len(d), what=mode)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])


@pytest.mark.cuda
def test_cuda_packed_without_a_device_sync_and_compiled_once():
    """On CUDA the values of cu_seqlens are not read: every helper and packed_targets run without
    a device sync (torch.cuda.set_sync_debug_mode("error") raises on one), equal to the float64
    formula; compiled with Inductor, one graph as S and T change."""
    def on_cuda(d):
        return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in d.items()}

    def run(g):
        x, m, cu = g["loss"][None], g["mask"][None], g["cu"]
        aggs = [torch_fused.aggregate_loss(x, m, mode, cu_seqlens=cu, **_agg_kwargs(mode, g)) for mode in AGG_MODES]
        return aggs, torch_fused.masked_mean(x, m, 1, cu_seqlens=cu), torch_fused.packed_targets(m, cu, 0)

    run(on_cuda(_data(RUNS[0], 0, "float32")))  # first calls (kernel compiles) outside the sync check
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    for i, lengths in enumerate(RUNS):
        d = _data(lengths, i, "float32")
        g = on_cuda(d)
        torch.cuda.set_sync_debug_mode("error")
        try:
            aggs, means, _ = run(g)
        finally:
            torch.cuda.set_sync_debug_mode(before)
        for mode, v in zip(AGG_MODES, aggs):
            _assert_matches(v.cpu(), d, mode, _norm_len(d), mode)
        _assert_matches(means.cpu()[0], d, "mean", what="masked_mean")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(_helpers, fullgraph=True, dynamic=True)
    for i, lengths in enumerate(RUNS):
        g = on_cuda(_data(lengths, i, "float32"))
        got = f(g["loss"][None], g["mask"][None], g["cu"], _norm_len(g))
        want = _helpers(g["loss"][None], g["mask"][None], g["cu"], _norm_len(g))
        for name, a, b in zip(COMPILED, got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])


# ---------------------------------------------------------------------------------------------
# errors: eager and compiled, naming the argument
# ---------------------------------------------------------------------------------------------

def _call(fn_name):
    def call(x, m, cu, **kw):
        if fn_name == "aggregate_loss":
            return torch_fused.aggregate_loss(x, m, "seq-mean-token-mean", cu_seqlens=cu, **kw)
        if fn_name == "masked_mean":
            return torch_fused.masked_mean(x, m, 1, cu_seqlens=cu)
        if fn_name == "mask_reduce":
            return torch_fused.mask_reduce(x, 1, m, cu_seqlens=cu)
        return torch_fused.packed_targets(x, cu)
    return call


FN_NAMES = ["aggregate_loss", "masked_mean", "mask_reduce", "packed_targets"]
BAD_CU = [  # (id, cu_seqlens, eager message, compiled message or None for the same)
    ("float dtype", torch.tensor([0.0, 2.0, 5.0]), r"cu_seqlens: expected dtype int32 \(or int64\), got torch.float32",
     None),
    ("2-D", torch.tensor([[0, 2, 5]], dtype=torch.int32),
     r"cu_seqlens: expected a 1-D tensor \[S\+1\], got shape \(1, 3\)", None),
    ("empty", torch.zeros(0, dtype=torch.int32), r"cu_seqlens: expected at least one value", None),
    ("first", torch.tensor([1, 2, 5], dtype=torch.int32),
     r"cu_seqlens: expected 0 first \(cu_seqlens\[0\] == 0\), got 1",
     r"cu_seqlens: expected values that start at 0, never decrease and end at the packed length"),
    ("decreasing", torch.tensor([0, 3, 2, 5], dtype=torch.int32),
     r"cu_seqlens: expected non-decreasing values \(cumulative lengths\), got 2 after 3 at index 2",
     r"cu_seqlens: expected values that start at 0, never decrease and end at the packed length"),
    ("last", torch.tensor([0, 2, 4], dtype=torch.int32), r"cu_seqlens: expected the packed length 5 \(.*\) last, got 4",
     r"cu_seqlens: expected values that start at 0, never decrease and end at the packed length"),
]


@pytest.mark.parametrize("fn_name", FN_NAMES)
@pytest.mark.parametrize("cu,eager_msg,compiled_msg", [b[1:] for b in BAD_CU], ids=[b[0] for b in BAD_CU])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bad_cu_seqlens_raise_naming_it(fn_name, cu, eager_msg, compiled_msg, mode):
    x = torch.randn(1, 5) if fn_name != "packed_targets" else torch.arange(5)[None]
    m = torch.ones(1, 5, dtype=torch.bool)
    f = _call(fn_name)
    msg = eager_msg
    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
        msg = compiled_msg or eager_msg
    with pytest.raises(Exception, match=msg):
        f(x, m, cu)


@pytest.mark.parametrize("fn_name", FN_NAMES)
def test_cu_seqlens_type_and_device(fn_name):
    x = torch.randn(1, 5) if fn_name != "packed_targets" else torch.arange(5)[None]
    m = torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"cu_seqlens: expected an int32 tensor \[S\+1\].*got list"):
        _call(fn_name)(x, m, [0, 2, 5])
    with pytest.raises(RuntimeError,
                       match=r"cu_seqlens: expected device cpu \(the device of (loss|values|x|input_ids)\), got meta"):
        _call(fn_name)(x, m, torch.tensor([0, 2, 5], dtype=torch.int32, device="meta"))


BAD_ARGS = [  # (id, call, exception, message)
    ("loss rows", lambda cu: torch_fused.aggregate_loss(torch.randn(2, 5), torch.ones(2, 5), cu_seqlens=cu),
     RuntimeError, r"loss: with cu_seqlens, expected a packed row \[1, T\] or \[T\], got shape \(2, 5\)"),
    ("loss 3-D", lambda cu: torch_fused.aggregate_loss(torch.randn(1, 5, 1), torch.ones(1, 5, 1), cu_seqlens=cu),
     RuntimeError, r"loss: with cu_seqlens, expected a packed row"),
    ("norm_len missing", lambda cu: torch_fused.aggregate_loss(torch.randn(1, 5), torch.ones(1, 5),
                                                               "seq-mean-token-sum-norm", cu_seqlens=cu),
     ValueError, r"norm_len: required with cu_seqlens in mode 'seq-mean-token-sum-norm'"),
    ("norm_len other mode", lambda cu: torch_fused.aggregate_loss(torch.randn(1, 5), torch.ones(1, 5), "token-mean",
                                                                  cu_seqlens=cu, norm_len=4),
     ValueError, r"norm_len: only for mode 'seq-mean-token-sum-norm'.*got norm_len=4 with mode 'token-mean'"),
    ("norm_len zero", lambda cu: torch_fused.aggregate_loss(torch.randn(1, 5), torch.ones(1, 5),
                                                            "seq-mean-token-sum-norm", cu_seqlens=cu, norm_len=0),
     ValueError, r"norm_len: expected a positive finite number, got 0"),
    ("norm_len nan", lambda cu: torch_fused.aggregate_loss(torch.randn(2, 5), torch.ones(2, 5),
                                                           "seq-mean-token-sum-norm", norm_len=float("nan")),
     ValueError, r"norm_len: expected a positive finite number, got nan"),
    ("norm_len type", lambda cu: torch_fused.aggregate_loss(torch.randn(1, 5), torch.ones(1, 5),
                                                            "seq-mean-token-sum-norm", cu_seqlens=cu, norm_len="5"),
     TypeError, r"norm_len: expected a positive int or float, got '5'"),
    ("mask shape", lambda cu: torch_fused.aggregate_loss(torch.randn(1, 5), torch.ones(1, 4), cu_seqlens=cu),
     RuntimeError, r"mask: shape \(1, 4\) does not broadcast to loss of shape \(1, 5\)"),
    ("targets ignore_index", lambda cu: torch_fused.packed_targets(torch.arange(5), cu, ignore_index=None),
     TypeError, r"ignore_index: expected an int, got None"),
    ("targets 0-dim", lambda cu: torch_fused.packed_targets(torch.tensor(3), cu),
     RuntimeError, r"input_ids: expected a tensor \[\.\.\., T\]"),
    # an ignore_index its dtype cannot hold (a cast would wrap it into a real id or a True)
    ("targets bool -100", lambda cu: torch_fused.packed_targets(torch.ones(5, dtype=torch.bool), cu),
     ValueError, r"ignore_index: -100 is not a value of input_ids' dtype torch.bool"),
    ("targets uint8 -100", lambda cu: torch_fused.packed_targets(torch.ones(5, dtype=torch.uint8), cu),
     ValueError, r"ignore_index: -100 is not a value of input_ids' dtype torch.uint8"),
    ("targets int32 2**40", lambda cu: torch_fused.packed_targets(torch.ones(5, dtype=torch.int32), cu, 2**40),
     ValueError, r"ignore_index: 1099511627776 is not a value of input_ids' dtype torch.int32"),
]


@pytest.mark.parametrize("call,exc,msg", [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_raise_naming_them(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call(_cu([2, 3]))


def test_cu_seqlens_values_checked_on_cpu_only_where_it_costs_no_sync():
    """A meta tensor stands for a device whose values are not read: shapes are still checked,
    values not (the call runs on meta tensors and returns the right shape)."""
    x = torch.randn(1, 5, device="meta")
    cu = torch.tensor([3, 1, 9], dtype=torch.int32, device="meta")
    assert torch_fused.mask_reduce(x, 1, cu_seqlens=cu).shape == (1, 2)
    assert torch_fused.aggregate_loss(x, torch.ones(1, 5, device="meta"), "seq-mean-token-sum",
                                      cu_seqlens=cu).shape == ()


# ---------------------------------------------------------------------------------------------
# the log-prob ops on a packed row: packed_targets
# ---------------------------------------------------------------------------------------------

TARGET_RUNS = [[3, 0, 1, 4, 0], [0, 2, 5], [6]]  # empty ones first, between and last; a 1-token one
V = 11


def _row(lengths, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return torch.randint(0, V, (1, t), generator=g), torch.randn(1, t, V, generator=g, dtype=dtype), _cu(lengths)


def test_packed_targets_values():
    ids = torch.arange(10, 18)[None]
    cu = _cu([0, 3, 0, 1, 4, 0])
    assert torch_fused.packed_targets(ids, cu).tolist() == [[11, 12, -100, -100, 15, 16, 17, -100]]
    assert torch_fused.packed_targets(ids[0], cu.long(), ignore_index=-1).tolist() == [11, 12, -1, -1, 15, 16, 17, -1]
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    shifted = torch_fused.packed_targets(mask, cu, 0)
    assert shifted.dtype == torch.bool and shifted.tolist() == [[True, True, False, False, True, True, True, False]]
    assert torch_fused.packed_targets(torch.zeros(1, 0, dtype=torch.long), _cu([0, 0])).shape == (1, 0)


@pytest.mark.parametrize("lengths", TARGET_RUNS, ids=str)
def test_packed_logprobs_equal_each_sequence_alone(lengths):
    """selective_log_softmax(logits [1, T, V], packed_targets(ids, cu)) equals each sequence scored
    alone with shift=True (0 at each sequence's last position); so does the shift=True recipe
    with packed_targets(...)[:, :-1]; the logits' gradient is the per-sequence gradients laid
    end to end (0 at each last position), and a sequence's log-probs have no gradient outside
    its own positions."""
    ids, logits, cu = _row(lengths, sum(lengths))
    x = logits.clone().requires_grad_(True)
    tgt = torch_fused.packed_targets(ids, cu)
    logp = torch_fused.selective_log_softmax(x, tgt)
    shifted = torch_fused.selective_log_softmax(x, tgt[:, :-1], shift=True)
    torch.testing.assert_close(shifted, logp[:, :-1], rtol=0, atol=0)
    c = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad((logp * c).sum(), x)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for a, b in bounds:
        if b == a:
            continue
        assert logp[0, b - 1].item() == 0
        y = logits[:, a:b].clone().requires_grad_(True)
        alone = torch_fused.selective_log_softmax(y, ids[:, a + 1:b], shift=True)
        torch.testing.assert_close(logp[:, a:b - 1], alone, rtol=0, atol=0)
        (g_alone,) = torch.autograd.grad((alone * c[:, a:b - 1]).sum(), y)
        torch.testing.assert_close(grad[:, a:b], g_alone, rtol=0, atol=0)
        (g_seq,) = torch.autograd.grad(torch_fused.selective_log_softmax(x, tgt)[:, a:b].sum(), x)
        outside = torch.ones(g_seq.shape[1], dtype=torch.bool)
        outside[a:b - 1] = False
        assert bool((g_seq[:, outside] == 0).all()), (a, b)
    # without the recipe the shifted op scores across every boundary (what the test would catch)
    naive = torch_fused.selective_log_softmax(logits, ids[:, 1:], shift=True)
    ends = [b - 1 for a, b in bounds[:-1] if b > a and b < sum(lengths)]
    assert all(naive[0, e].item() != 0 for e in ends)


def test_packed_logprobs_and_loss_compiled_dynamic():
    """The packed training loss (targets, log-probs, entropy, aggregate_loss with cu_seqlens) in
    one torch.compile(fullgraph=True, dynamic=True) graph as S and T change, equal to eager
    (aot_eager: the log-prob ops are opaque; the test above runs the rest through Inductor)."""
    def loss_fn(logits, ids, mask, cu, n):
        tgt = torch_fused.packed_targets(ids, cu)
        keep = torch_fused.packed_targets(mask, cu, 0)
        logp, ent = torch_fused.logprobs_and_entropy(logits, tgt)
        per_token = -logp - 0.01 * ent
        return (torch_fused.aggregate_loss(per_token, keep, "seq-mean-token-mean", cu_seqlens=cu),
                torch_fused.aggregate_loss(per_token, keep, "seq-mean-token-sum-norm", cu_seqlens=cu, norm_len=n))

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(loss_fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, lengths in enumerate([[3, 0, 4], [2, 2, 5, 1], [4, 3]]):
        ids, logits, cu = _row(lengths, i)
        mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(i)) > 0.2
        got, want = [], []
        for fn, out in ((f, got), (loss_fn, want)):
            x = logits.clone().requires_grad_(True)
            vals = fn(x, ids, mask, cu, max(lengths))
            out.extend([*vals, *torch.autograd.grad(sum(vals), x)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])


def test_packed_grpo_loss_equals_padded():
    """End to end: the per-token loss of a packed row through packed_targets, with the shifted
    completion mask, under every mode equals the padded batch's loss through shift=True (the
    padded length L - 1 positions as norm_len)."""
    lengths = [4, 1, 6, 3]
    ids, logits, cu = _row(lengths, 3, torch.float64)
    comp = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) > 0.3
    lmax = max(lengths)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    ids_pad = torch.zeros(len(lengths), lmax, dtype=torch.long)
    logits_pad = torch.zeros(len(lengths), lmax, V, dtype=torch.float64)
    comp_pad = torch.zeros(len(lengths), lmax, dtype=torch.bool)
    for s, (a, b) in enumerate(bounds):
        ids_pad[s, : b - a], logits_pad[s, : b - a], comp_pad[s, : b - a] = ids[0, a:b], logits[0, a:b], comp[0, a:b]
    logp = torch_fused.selective_log_softmax(logits, torch_fused.packed_targets(ids, cu))
    keep = torch_fused.packed_targets(comp, cu, 0)
    logp_pad = torch_fused.selective_log_softmax(logits_pad, ids_pad[:, 1:], shift=True)
    keep_pad = comp_pad[:, 1:]
    for mode in AGG_MODES:
        kw = dict(norm_len=lmax - 1) if mode.endswith("norm") else {}
        torch.testing.assert_close(torch_fused.aggregate_loss(-logp, keep, mode, cu_seqlens=cu, **kw),
                                   torch_fused.aggregate_loss(-logp_pad, keep_pad, mode, **kw), msg=mode)


def test_unread_bad_values_never_index_out_of_bounds(monkeypatch):
    """Where the values of cu_seqlens are not read (CUDA; here with the CPU check switched off),
    bad values give wrong results but no read or write out of bounds: positions before
    cu_seqlens[0] or from cu_seqlens[-1] on are left out, and each packed row's last target is
    ignore_index."""
    import torch_fused.masked as masked
    import torch_fused.packed as packed

    monkeypatch.setattr(masked, "check_cu_values", lambda *a: None)
    monkeypatch.setattr(packed, "check_cu_values", lambda *a: None)
    x = torch.arange(1.0, 7.0)[None]  # 1 2 3 4 5 6
    m = torch.ones(1, 6, dtype=torch.bool)
    cu = torch.tensor([1, 3, 3, 5], dtype=torch.int32)  # positions 0 and 5 are outside
    assert torch_fused.mask_reduce(x, 1, m, cu_seqlens=cu).tolist() == [[5.0, 0.0, 9.0]]
    assert torch_fused.masked_mean(x, m, 1, cu_seqlens=cu).tolist() == [[2.5, 0.0, 4.5]]
    assert torch_fused.aggregate_loss(x, m, "seq-mean-token-sum", cu_seqlens=cu).item() == pytest.approx(14 / 3)
    assert torch_fused.aggregate_loss(x, m, "seq-mean-token-mean", cu_seqlens=cu).item() == 3.5
    assert torch_fused.packed_targets(torch.arange(6)[None], torch.tensor([0, 2], dtype=torch.int32)).tolist() == \
        [[1, -100, 3, 4, 5, -100]]
    assert torch_fused.packed_targets(torch.arange(4), torch.tensor([0, 9, 2], dtype=torch.int32)).tolist()[-1] == -100
