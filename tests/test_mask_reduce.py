"""fused::mask_reduce (CPU reference path, the interpreter run, and CUDA on the device). The
helpers of torch_fused.masked built on it are in test_masked.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fused
from torch_fused._library import INTERPRET
from _helpers import DEVICES, SMALL

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
OUT_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5, torch.float64: 1e-12}


@st.composite
def mr_cases(draw):
    rank = draw(st.integers(1, 4))
    hi = 5 if SMALL else 9
    shape = [draw(st.sampled_from([0, 1, 2, 3, hi, 17 if not SMALL else 6])) if draw(st.booleans()) else
             draw(st.integers(1, hi)) for _ in range(rank)]
    if draw(st.integers(0, 9)) > 0:  # mostly non-empty
        shape = [max(1, s) for s in shape]
    dim = draw(st.integers(-rank, rank - 1))

    def pattern():
        # per dim: 'full' | 'one' (size-1, broadcast by shape) | 'expand' (stride-0 view)
        pats = [draw(st.sampled_from(["full", "one", "expand"])) for _ in range(rank)]
        drop = draw(st.integers(0, rank - 1))  # leading dims left out entirely
        return pats, drop

    return dict(
        shape=shape, dim=dim,
        dtype=draw(st.sampled_from(FLOATS)),
        mask=draw(st.sampled_from([None, "bool", "int", "float"])), mpat=pattern(),
        scale=draw(st.sampled_from([None, torch.float32, torch.bfloat16])), spat=pattern(),
        x_layout=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
        out_dtype=draw(st.sampled_from([None, torch.float32])),
        seed=draw(st.integers(0, 2**16)),
    )


def _operand(shape, pats, drop, make, device):
    """A tensor broadcastable to shape with the given per-dim pattern, and its materialized copy."""
    # the first `drop` dims are left out of the operand (broadcast by rank); building it from
    # the kept dims only also covers a size-0 leading dim, which indexing [0] could not drop
    pats, kept = pats[drop:], list(shape)[drop:]
    store = [1 if p != "full" else s for p, s in zip(pats, kept)]
    t = make(store).to(device)
    view = t.expand([s if p == "expand" else st for p, s, st in zip(pats, kept, store)])
    return view, torch.broadcast_to(view.cpu(), shape).contiguous()


def _x(shape, dtype, layout, gen, device):
    if layout == "transposed" and len(shape) >= 2:
        base = torch.randn(list(reversed(shape)), generator=gen, dtype=torch.float64)
        return base.to(dtype).to(device).permute(*reversed(range(len(shape))))
    if layout == "sliced":
        base = torch.randn(shape[:-1] + [shape[-1] + 2], generator=gen, dtype=torch.float64)
        return base.to(dtype).to(device)[..., 1:-1]
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@given(c=mr_cases())
def test_mask_reduce_matches_float64_reference(device, c):
    gen = torch.Generator().manual_seed(c["seed"])
    shape = c["shape"]
    x = _x(shape, c["dtype"], c["x_layout"], gen, device).requires_grad_(True)
    mask = mfull = scale = sfull = None
    if c["mask"]:
        mk = {"bool": lambda s: torch.rand(s, generator=gen) < 0.6,
              "int": lambda s: torch.randint(0, 3, s, generator=gen, dtype=torch.int32),
              # mask_reduce's float mask selects (nonzero and NaN keep); weights go in scale
              "float": lambda s: torch.tensor([0.0, 0.5, -1.0, float("nan")])[
                  torch.randint(0, 4, s, generator=gen)]}[c["mask"]]
        mask, mfull = _operand(shape, *c["mpat"], mk, device)
    if c["scale"]:
        sk = lambda s: torch.rand(s, generator=gen).to(c["scale"])  # noqa: E731
        scale, sfull = _operand(shape, *c["spat"], sk, device)
    y = torch_fused.mask_reduce(x, c["dim"], mask, scale, out_dtype=c["out_dtype"])
    xd = x.detach().cpu().double()
    v = xd * (sfull.double() if sfull is not None else 1.0)
    if mfull is not None:
        v = torch.where(mfull != 0, v, torch.zeros((), dtype=torch.float64))
    ref = v.sum(c["dim"])
    assert y.shape == ref.shape and y.dtype == (c["out_dtype"] or c["dtype"])
    tol = OUT_TOL[c["out_dtype"] or c["dtype"]]
    err = (y.detach().cpu().double() - ref).abs()
    bound = tol * (v.abs().sum(c["dim"]) + 1e-6)  # the output's rounding, relative to the terms summed
    assert bool((err <= bound).all()), f"max err {err.max().item()}"
    # gradient: dy broadcast over dim, times scale, 0 where masked
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, x, gy.to(device, y.dtype))
    rdx = gy.unsqueeze(c["dim"]).to(y.dtype).double().expand(shape)
    if sfull is not None:
        rdx = rdx * sfull.double()
    if mfull is not None:
        rdx = torch.where(mfull != 0, rdx, torch.zeros((), dtype=torch.float64))
    assert dx.dtype == x.dtype and dx.shape == x.shape
    torch.testing.assert_close(dx.cpu().double(), rdx.to(x.dtype).double(), rtol=OUT_TOL[x.dtype] * 2, atol=1e-6)


def _formula(x, dim, mfull, sfull):
    """float64 sum over dim of x * scale where mask != 0, from the materialized mask and scale."""
    v = x.detach().cpu().double() * (sfull.double() if sfull is not None else 1.0)
    if mfull is not None:
        v = torch.where(mfull != 0, v, torch.zeros((), dtype=torch.float64))
    return v.sum(dim), v.abs().sum(dim)


NAN = float("nan")


def _record_launches(monkeypatch) -> list:
    """The constexprs of every mask_reduce kernel launch from here on (the interpreter run)."""
    from torch_fused.kernels import mask_reduce as K

    seen = []
    real = K.launch_config

    def spy(*args):
        out = real(*args)
        seen.append(out[1])
        return out

    monkeypatch.setattr(K, "launch_config", spy)
    return seen


def _stored(shape, kind, gen):
    """A mask's or a scale's stored elements; a mask keeps some and drops some whatever the seed
    (first element dropped, last kept), so reading the wrong mask element shows."""
    if kind in ("bool", "int"):
        m = torch.randint(-1, 2, shape, generator=gen, dtype=torch.int32)
        m.view(-1)[0], m.view(-1)[-1] = 0, 1
        return m != 0 if kind == "bool" else m
    return (torch.rand(shape, generator=gen) + 0.5).to(kind)  # a scale


# One case per branch of the kernel and its launcher, at sizes the interpreter runs quickly:
# (id, x shape, dim, x layout, mask (storage shape, kind) or None, scale (storage shape, dtype) or
# None, x dtype, the launch constexprs expected under the interpreter's tiny tiles (conftest:
# BLOCK_R 2, U 2, BLOCK_I 4, PIPELINE for even reduce lengths)). Masks and scales of x's rank are
# passed expanded (stride-0 views); those of lower rank as stored (broadcast by rank).
BRANCH_CASES = [
    ("mask bcast along r", (6, 5), 0, "contiguous", ((1, 5), "bool"), None, torch.float32,
     dict(M_BCAST_R=True, M_BCAST_I=False, PRED_X=False, PIPELINE=True)),
    ("[T,k,1] mask: bcast along i, x predicated", (3, 5, 6), 1, "contiguous", ((3, 5, 1), "bool"),
     ((1, 5, 6), torch.float32), torch.bfloat16,
     dict(M_BCAST_I=True, PRED_X=True, PIPELINE=False, M_EVICT="evict_last", X_EVICT="evict_first", OUTER_FIRST=False)),
    ("[1,M,N] mask shared by outer rows, scale bcast along i", (3, 4, 6), 1, "contiguous", ((1, 4, 6), "int"),
     ((3, 4, 1), torch.bfloat16), torch.float16,
     dict(OUTER_FIRST=True, M_BCAST_R=False, M_BCAST_I=False, S_BCAST_I=True, M_EVICT="evict_last")),
    ("r contiguous, [B,1] mask, scale bcast along i", (3, 8), -1, "contiguous", ((3, 1), "bool"),
     ((1, 8), torch.float32), torch.float32,
     dict(M_BCAST_R=True, PRED_X=True, S_BCAST_I=True, PIPELINE=True, EVEN=False)),
    ("r contiguous, odd length, scale bcast along r", (4, 7), 1, "contiguous", ((4, 7), "int"),
     ((4, 1), torch.float32), torch.float64, dict(S_BCAST_R=True, PIPELINE=False, ACC_F64=True)),
    ("even tiles", (2, 4, 8), 1, "contiguous", ((2, 4, 8), "bool"), None, torch.float32,
     dict(EVEN=True, PIPELINE=True, PRED_X=False)),
    ("4-D transposed x, mask bcast over two dims", (2, 3, 4, 5), 2, "transposed", ((2, 1, 4, 1), "bool"),
     ((3, 1, 5), torch.float32), torch.float32, dict(M_BCAST_I=True, OUTER_FIRST=True, PRED_X=True)),
    ("sliced x, no mask", (3, 6, 5), 1, "sliced", None, ((6, 1), torch.float32), torch.bfloat16,
     dict(HAS_MASK=False, S_BCAST_I=True)),
    ("[M,1] mask of lower rank, shared by outer rows", (2, 4, 6), 1, "contiguous", ((4, 1), "bool"), None,
     torch.float32, dict(M_BCAST_I=True, OUTER_FIRST=True, PRED_X=True, PIPELINE=True)),
    ("reduce stride 2**29: int64 tile offsets", (1, 6), 0, "wide", ((1, 6), "bool"), None, torch.float32,
     dict(WIDE=True)),
    ("[B,M,1] mask over a long reduce dim: kept rows listed, scale bcast along r", (3, 9, 6), 1, "contiguous",
     ((3, 9, 1), "int"), ((3, 1, 6), torch.float32), torch.bfloat16,
     dict(COMPACT=True, PRED_X=True, MASK_AHEAD=False, S_BCAST_R=True)),
    ("[B,M,1] mask, even reduce length: listed rows through the loop pipeliner, scale bcast along r", (2, 10, 6), 1,
     "contiguous", ((2, 10, 1), "bool"), ((2, 1, 6), torch.float32), torch.float32,
     dict(COMPACT=True, NUM_STAGES=2, S_BCAST_R=True)),
    ("[M,1] mask shared by outer rows, listed once, transposed x", (2, 3, 11, 5), 2, "transposed",
     ((11, 1), "bool"), None, torch.float32, dict(COMPACT=True, OUTER_FIRST=True)),
    ("[B,M,1] mask, per-element scale: not listed", (2, 9, 6), 1, "contiguous", ((2, 9, 1), "bool"),
     ((2, 9, 6), torch.float32), torch.float32, dict(COMPACT=False, PRED_X=True)),
]


@pytest.mark.parametrize("case", BRANCH_CASES, ids=[c[0] for c in BRANCH_CASES])
def test_kernel_branches_match_float64_formula(case, monkeypatch):
    """Each case drives one branch (named in its id, and, under the interpreter, pinned by the
    launch's constexprs) and compares y and dx with the float64 formula on the materialized
    mask and scale. Masked-off x is NaN, so a mask read at the wrong element shows."""
    name, shape, dim, layout, mcase, scase, dtype, flags = case
    seen = _record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    mask = mfull = scale = sfull = None
    if mcase:
        m = _stored(mcase[0], mcase[1], gen)
        mask, mfull = m.expand(shape) if m.dim() == len(shape) else m, torch.broadcast_to(m, shape).contiguous()
    if scase:
        sc = _stored(scase[0], scase[1], gen)
        scale, sfull = sc.expand(shape) if sc.dim() == len(shape) else sc, torch.broadcast_to(sc, shape).contiguous()
    xv = torch.randn(shape, generator=gen, dtype=torch.float64)
    if mfull is not None:
        xv = torch.where(mfull != 0, xv, torch.full((), NAN, dtype=torch.float64))
    xv = xv.to(dtype)
    if layout == "transposed":
        x = xv.permute(*reversed(range(len(shape)))).contiguous().permute(*reversed(range(len(shape))))
    elif layout == "sliced":
        x = torch.cat([xv, xv[..., :1]], -1)[..., :-1]
    elif layout == "wide":  # one row of a reduce dim whose stride is 2**29 (a size-1 dim's stride is free)
        x = xv.contiguous().as_strided(shape, (2**29, 1))
    else:
        x = xv
    x.requires_grad_(True)
    y = torch_fused.mask_reduce(x, dim, mask, scale, out_dtype=torch.float32 if dtype != torch.float64 else None)
    ref, mag = _formula(x, dim, mfull, sfull)
    tol = OUT_TOL[y.dtype]
    err = (y.detach().double() - ref).abs()
    assert bool((err <= tol * (mag + 1e-6)).all()), f"{name}: max err {err.max().item()}, y {y}, ref {ref}"
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, x, gy.to(y.dtype))
    rdx = gy.unsqueeze(dim).to(y.dtype).double().expand(shape) * (sfull.double() if sfull is not None else 1.0)
    if mfull is not None:
        rdx = torch.where(mfull != 0, rdx, torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(dx.double(), rdx.to(dtype).double(), rtol=OUT_TOL[dtype] * 2, atol=1e-6)
    if INTERPRET:  # the case still reaches its branch
        assert len(seen) == 1, f"{name}: {len(seen)} launches"
        got = {k: seen[0][k] for k in flags}
        assert got == flags, f"{name}: launch constexprs {got}, expected {flags}"


@pytest.mark.parametrize("shape,dim", [((3, 0, 4), 1), ((0, 5), 1), ((2, 3), 0)])
def test_mask_reduce_empty_and_zero_length(shape, dim):
    x = torch.randn(shape)
    mask = torch.ones(shape, dtype=torch.bool)
    y = torch_fused.mask_reduce(x, dim, mask)
    torch.testing.assert_close(y, x.sum(dim))


SHIPPED_TILE_CASES = [
    # (x shape, dtype, dim, mask storage shape or None, scale storage shape or None, expected
    # constexprs): each hits one branch of kernels.mask_reduce.pick_blocks with n_sm=1
    ((8, 3, 600), torch.bfloat16, 1, (8, 3, 600), None, dict(BLOCK_R=1, BLOCK_I=512, U=4)),  # many outputs, R < trip
    ((1, 300, 200), torch.float32, 1, (1, 300, 200), None, dict(BLOCK_R=16, BLOCK_I=32, U=16)),  # strips, tail trip
    ((2, 300, 96), torch.float32, 1, (1, 300, 96), None, dict(BLOCK_R=16, BLOCK_I=32, OUTER_FIRST=True)),  # shared mask
    ((5, 3000), torch.bfloat16, -1, (5, 3000), (1, 3000), dict(BLOCK_R=2048, PIPELINE=True)),  # reduce dim contiguous
    # [B, M, 1] mask, short reduce dim: walked row by row (row-mask tiles: wider runs, one warp)
    ((10, 4, 700), torch.float16, 1, (10, 4, 1), (1, 1, 700), dict(BLOCK_I=1024, PRED_X=True, COMPACT=False)),
    # [B, M, 1] masks over long reduce dims: kept rows listed, in row tiles (rows walked by hand)
    # and in strips (Triton's loop pipeliner, listed rows one per row of threads)
    ((4, 300, 200), torch.bfloat16, 1, (4, 300, 1), None, dict(COMPACT=True, BLOCK_R=1, BLOCK_I=128, U=32,
                                                               NUM_STAGES=1)),
    ((1, 300, 200), torch.float32, 1, (1, 300, 1), None, dict(COMPACT=True, BLOCK_R=32, U=1, NUM_STAGES=4)),
    # strips under a row mask over fewer than compact_min_rows rows: every row walked, x predicated
    ((1, 60, 200), torch.float32, 1, (1, 60, 1), None, dict(COMPACT=False, BLOCK_R=8, U=8, PRED_X=True)),
]


@pytest.mark.skipif(not INTERPRET, reason="the shipped tiles run as-is on CUDA; here through the interpreter")
@pytest.mark.parametrize("case", SHIPPED_TILE_CASES, ids=lambda c: "x".join(map(str, c[0])) if isinstance(c, tuple) else None)
def test_shipped_tile_configs_match_reference(case, monkeypatch, settings_override):
    """The suite runs the interpreter with tiny tiles; this runs the tiles the picker ships
    (software-pipelined loop, several rows per thread, masked tails) on small shapes."""
    from torch_fused.kernels import mask_reduce as K

    shape, dtype, dim, mshape, sshape, flags = case
    settings_override(small_tiles=False)
    shipped = K.pick_blocks
    monkeypatch.setattr(K, "pick_blocks", lambda r, i, n_outer, rc, xb, n_sm, **kw: shipped(r, i, n_outer, rc, xb, 1, **kw))
    seen = _record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = (torch.rand(mshape, generator=gen) < 0.6).expand(shape) if mshape else None
    scale = torch.rand(sshape, generator=gen, dtype=torch.float64).expand(shape) if sshape else None
    if mask is not None:  # masked-off x is NaN: it must not reach y
        x = torch.where(mask, x, torch.full((), NAN, dtype=torch.float64))
    xn = x.to(dtype)
    y = torch_fused.mask_reduce(xn, dim, mask, None if scale is None else scale.float(), out_dtype=torch.float32)
    v = xn.double() * (scale if scale is not None else 1.0)
    if mask is not None:
        v = torch.where(mask, v, torch.zeros((), dtype=torch.float64))
    ref = v.sum(dim)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    assert {k: seen[0][k] for k in flags} == flags


@pytest.mark.skipif(not INTERPRET, reason="the interpreter runs the tile options at small shapes")
@pytest.mark.parametrize("shape,dtype", [((1, 300, 200), torch.float32), ((2, 333, 100), torch.bfloat16)])
def test_row_mask_strips_with_mask_prefetch_match_reference(shape, dtype, monkeypatch, settings_override):
    """The row-mask strips that walk every row (compact_strips off, as --sweep times them) with
    their mask loaded a trip ahead (TILES["row_mask_strip_ahead"], off as shipped): several rows
    per trip and thread (BLOCK_R > 1), a reduce
    length that is no multiple of the trip, NaN under the mask kept out."""
    from torch_fused.kernels import mask_reduce as K

    settings_override(small_tiles=False, mask_reduce_tiles={**K.TILES, "row_mask_strip_ahead": True,
                                                            "compact_strips": False})
    shipped = K.pick_blocks
    monkeypatch.setattr(K, "pick_blocks", lambda r, i, n_outer, rc, xb, n_sm, **kw: shipped(r, i, n_outer, rc, xb, 1, **kw))
    seen = _record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(shape[0], shape[1], 1, generator=gen) < 0.6).expand(shape)
    x = torch.where(mask, torch.randn(shape, generator=gen, dtype=torch.float64), torch.full((), NAN, dtype=torch.float64))
    y = torch_fused.mask_reduce(x.to(dtype), 1, mask, out_dtype=torch.float32)
    ref = torch.where(mask, x.to(dtype).double(), torch.zeros((), dtype=torch.float64)).sum(1)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    assert seen[0]["MASK_AHEAD"] and seen[0]["BLOCK_R"] > 1 and not seen[0]["COMPACT"], seen[0]
    assert shape[1] % (seen[0]["BLOCK_R"] * seen[0]["U"]) != 0


@pytest.mark.parametrize("device", DEVICES)
def test_masked_values_never_reach_the_result(device):
    x = torch.randn(4, 3, 8, device=device)
    keep = torch.tensor([[1, 0, 1]] * 4, dtype=torch.bool, device=device)[..., None]
    x[:, 1] = float("nan")
    y = torch_fused.mask_reduce(x, 1, keep.expand(4, 3, 8))
    torch.testing.assert_close(y, x[:, 0] + x[:, 2])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_mask_reduce(device):
    x = torch.randn(3, 4, 5, device=device, requires_grad=True)
    m = (torch.rand(3, 4, 1, device=device) > 0.3).expand(3, 4, 5)
    s = torch.rand(1, 4, 5, device=device)
    torch.library.opcheck(torch.ops.fused.mask_reduce, (x, 1, m, s, None))
    torch.library.opcheck(torch.ops.fused.mask_reduce, (x, -1, None, None, torch.float64))
    torch.library.opcheck(torch.ops.fused.mask_reduce_backward, (torch.randn(3, 5, device=device), x.detach(), 1, m, s))


def test_gradcheck_mask_reduce():
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    m = (torch.rand(3, 1, 5) > 0.3)
    s = torch.rand(4, 1, dtype=torch.float64)
    # the interpreter runs the forward kernel for each of the 2 * 60 perturbations of the full
    # check; there a random projection of the Jacobian (fast_mode) checks the same formula
    assert torch.autograd.gradcheck(lambda t: torch_fused.mask_reduce(t, 1, m, s), (x,), fast_mode=INTERPRET)


def test_compile_fullgraph_mask_reduce_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    # the op is opaque to either backend: the interpreter run checks its kernels inside a compiled
    # graph with the cheaper aot_eager, the CPU run Inductor's code around the op
    cnt = CompileCounterWithBackend("aot_eager" if INTERPRET else "inductor")

    def combine(h, keep, w):  # MoE combine: [T, k, H] under a [T, k, 1] keep-mask
        return torch_fused.mask_reduce(h, 1, keep.expand_as(h), w.unsqueeze(-1)).float().pow(2).mean()

    f = torch.compile(combine, fullgraph=True, backend=cnt, dynamic=True)
    for t in (3, 5, 7):
        h = torch.randn(t, 2, 8, requires_grad=True)
        keep = torch.rand(t, 2, 1) > 0.3
        w = torch.rand(t, 2)
        out = f(h, keep, w)
        (g,) = torch.autograd.grad(out, h)
        h2 = h.detach().requires_grad_(True)
        ref = combine(h2, keep, w)
        (g2,) = torch.autograd.grad(ref, h2)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(g, g2)
    assert cnt.frame_count == 1


BAD = [
    (lambda: (torch.zeros(3, 4, dtype=torch.long), 1, None, None), r"x: expected dtype float16"),
    (lambda: (torch.zeros(2, 2, 2, 2, 2), 1, None, None), r"x: expected 1 to 4 dims, got 5"),
    (lambda: (torch.zeros(3, 4), 2, None, None), r"dim: expected a dim of x in \[-2, 2\), got 2"),
    (lambda: (torch.zeros(3, 4), 1.0, None, None), r"dim: expected an int, got float"),
    (lambda: (torch.zeros(3, 4), 1, torch.ones(3, 5, dtype=torch.bool), None), r"mask: shape \(3, 5\) does not broadcast"),
    (lambda: (torch.zeros(3, 4), 1, torch.ones(3, 4, dtype=torch.complex64), None),
     r"mask: expected a bool, integer or floating dtype, got torch.complex64"),
    (lambda: (torch.zeros(3, 4), 1, None, torch.ones(3, 4, dtype=torch.long)), r"scale: expected a floating dtype"),
]


@pytest.mark.parametrize("make,msg", BAD)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_mask_reduce_bad_input(make, msg, mode):
    x, dim, m, s = make()
    f = lambda x, m, s: torch_fused.mask_reduce(x, dim, m, s)  # noqa: E731
    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=msg):
        f(x, m, s)


@pytest.mark.skipif(INTERPRET, reason="a large logical size is for the CPU reference run")
def test_broadcast_mask_is_never_materialized():
    """Logical mask of 32 MiB (and x of 128 MiB logical), stored in kilobytes: the op and its cost
    model must finish with extra memory far below the logical size (peak RSS of a fresh process,
    over the output's size). The reference's chunk is made small so that its bounded temporaries
    stay far below that size too."""
    code = textwrap.dedent("""
        import resource, torch, torch_fused
        from torch_fused.settings import override
        override(reference_chunk_elems=1 << 16).__enter__()  # for the whole (short-lived) process
        T, K, H = 512, 64, 1024
        keep = (torch.rand(T, K, 1) > 0.5)
        mask = keep.expand(T, K, H)                      # 32 MiB logical, 32 KiB stored
        x = torch.randn(1, K, H).expand(T, K, H)         # 128 MiB logical (fp32), 256 KiB stored
        torch_fused.mask_reduce(x[:2], 1, mask[:2])      # first-call allocations out of the count
        torch_fused.mask_reduce_cost(x[:2], 1, mask[:2])
        y0 = torch.empty(T, H)                           # the output's size, touched and freed
        y0.fill_(0)
        del y0
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        y = torch_fused.mask_reduce(x, 1, mask)
        cost = torch_fused.mask_reduce_cost(x, 1, mask)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ref = (x[0].unsqueeze(0) * keep.float()).sum(1)  # small exact reference
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-3), (y - ref).abs().max()
        assert cost["mask_stored"] == T * K and cost["materialized_mask_bytes"] == T * K * H
        print(peak - base, mask.numel())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # one thread: no spinning against a busy machine
    assert proc.returncode == 0, proc.stderr[-3000:]
    extra, logical = map(int, proc.stdout.split())
    assert extra < logical / 8, f"peak extra {extra / 2**20:.1f} MiB for a {logical / 2**20:.0f} MiB logical mask"


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_2_31_elements_apart(device):
    """A reduce dim whose row stride times the row count passes 2**31 elements (a slice of a
    large tensor reduced over a dim other than the innermost): every trip's rows are read at
    their own offsets (a 32-bit trip offset wrapped row 4 onto row 0's elements). The storage
    is 8 GiB of which a few pages are written (virtual memory on the CPU)."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the kernel's offsets: the interpreter run (CPU) and CUDA")
    stride = 2**30 + 1
    store = torch.empty(4 * stride + 16, dtype=torch.float16, device=device)
    x = store.as_strided((5, 8), (stride, 1))
    for r in range(5):
        x[r] = torch.arange(1, 9, dtype=torch.float16, device=device) * (10.0 ** r if r < 4 else 0.0) + (7 if r == 4 else 0)
    y = torch_fused.mask_reduce(x, 0, out_dtype=torch.float32)
    torch.testing.assert_close(y.double().cpu(), x.double().sum(0).cpu())
    del x, store


@pytest.mark.parametrize("device", DEVICES)
def test_eager_fast_path_matches_the_registered_op(device, monkeypatch):
    """torch_fused.mask_reduce's eager fast path gives the registered op's values and gradients
    bit for bit (x requiring grad, a scale requiring grad, none), and under a dispatch mode the
    op is dispatched."""
    import torch_fused.masked as M
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(3, 5, 7, generator=g).to(device)
    mask = (torch.rand(1, 5, 1, generator=g) > 0.3).to(device).expand(3, 5, 7)
    s0 = torch.rand(3, 1, 7, generator=g).to(device)

    def run(x_grad, s_grad):
        x = x0.clone().requires_grad_(x_grad)
        s = s0.clone().requires_grad_(s_grad)
        y = torch_fused.mask_reduce(x, 1, mask, s)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device)
        grads = torch.autograd.grad((y * w).sum(), [t for t in (x, s) if t.requires_grad],
                                    allow_unused=True) if (x_grad or s_grad) else ()
        return (y.detach(),) + tuple(grads)

    for xg, sg in ((True, False), (False, True), (True, True), (False, False)):
        fast = run(xg, sg)
        monkeypatch.setattr(M, "eager_eligible", lambda *a: False)
        slow = run(xg, sg)
        monkeypatch.undo()
        assert len(fast) == len(slow)
        for a, b in zip(fast, slow):
            assert (a is None and b is None) or torch.equal(a, b), (xg, sg)

    class Seen(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "fused":
                Seen.seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Seen():
        torch_fused.mask_reduce(x0, 1, mask)
    assert Seen.seen == ["mask_reduce"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["[1,M,N] mask", "[B,M,1] mask (listed rows)", "[T,k,1] mask, [T,k] scale",
                                  "misaligned x", "no mask, reduce the last dim"])
def test_direct_launch_matches_kernel_grid(case, settings_override):
    """settings.direct_launch: mask_reduce's values are bit-identical to the kernel[grid]
    launches', on the first call (through kernel[grid]) and the later ones (through the compiled
    kernel's launcher, which they do take), with the row-id listing launch (COMPACT), and for an x
    whose data pointer is not 16-byte aligned after an aligned one of the same plan: the aligned
    one's kernel may assume aligned rows (a row stride divisible by 16), so the misaligned x needs
    its own."""
    from torch_fused.ops import mask_reduce as M

    g = torch.Generator(device="cuda").manual_seed(11)
    b = 512 if case.startswith("[B,M,1]") else 4  # many outputs: row tiles, where the rows are listed
    base = torch.randn(b, 96, 272, device="cuda", dtype=torch.bfloat16, generator=g)
    xs = [base[..., :256]] + ([base[..., 1:257]] if case == "misaligned x" else [])
    assert xs[0].data_ptr() % 16 == 0 and all(x.stride() == xs[0].stride() for x in xs)
    dim, mask, scale = 1, None, None
    if case in ("[1,M,N] mask", "misaligned x"):
        mask = (torch.rand(1, 96, 256, device="cuda", generator=g) > 0.4).expand(b, 96, 256)
    elif case == "[B,M,1] mask (listed rows)":
        mask = (torch.rand(b, 96, 1, device="cuda", generator=g) > 0.4).expand(b, 96, 256)
    elif case == "[T,k,1] mask, [T,k] scale":
        mask = torch.rand(b, 96, 1, device="cuda", generator=g) > 0.5
        scale = torch.rand(b, 96, 1, device="cuda", generator=g)
    else:
        dim = -1
    M._PLANS.clear()

    for x in xs:
        settings_override(direct_launch=False)
        want = torch_fused.mask_reduce(x, dim, mask, scale)
        settings_override(direct_launch=True)
        for _ in range(3):
            assert torch.equal(torch_fused.mask_reduce(x, dim, mask, scale), want), case
    (plan,) = M._PLANS.values()  # one plan: every x has the same shape and strides
    reduce, row_ids = plan[5], plan[6]
    assert len(reduce.compiled) == len(xs), reduce.compiled  # one compiled kernel per alignment
    assert (row_ids is not None) == case.startswith("[B,M,1]")
    if row_ids is not None:
        assert len(row_ids[1].compiled) == 1


def test_tiles_setting_must_replace_every_entry(settings_override):
    """mask_reduce_tiles replaces TILES whole: a dict missing entries (or with unknown ones) is
    refused with the setting's name and the entries at fault, not a KeyError deep in the tile
    choice; a full one is taken."""
    from torch_fused.kernels import mask_reduce as K

    st, sm = (4096, 0, 4096 * 4096, 1), (1, 0, 4096, 0)  # x [8, 4096, 4096], mask [8, 4096, 1]: (r, 0, 1, i)
    partial = {k: v for k, v in K.TILES.items() if k != "compact_strips"}
    for bad, what in [(partial, r"missing \['compact_strips'\], unknown \[\]"),
                      ({**K.TILES, "strip_rows": 4}, r"missing \[\], unknown \['strip_rows'\]")]:
        settings_override(small_tiles=False, mask_reduce_tiles=bad)
        with pytest.raises(ValueError, match="mask_reduce_tiles: expected a dict with the entries of .*" + what):
            K.launch_config(4096, 1, 8, 4096, st, sm, None, 2, False, 132)
        with pytest.raises(ValueError, match="mask_reduce_tiles"):
            K.tiles_key()
    settings_override(small_tiles=False, mask_reduce_tiles={**K.TILES, "compact_strips": False})
    _, cx, _ = K.launch_config(4096, 1, 8, 4096, st, sm, None, 2, False, 132)
    assert not cx["COMPACT"] and cx["PRED_X"] and cx["BLOCK_R"] > 1  # the strips walking every row


def test_dependent_launch_only_in_row_tiles_over_listed_rows(settings_override):
    """The tile choice asks for the programmatic dependent launch (PDL) where the reduce walks
    listed rows in row tiles (64x512x4096 row mask), never in the strips (8x4096x4096 row mask,
    measured slower with it) nor without listed rows; ops/mask_reduce.py grants it on CUDA
    devices of compute capability 9 and later only."""
    from torch_fused.kernels import mask_reduce as K
    from torch_fused.ops.mask_reduce import _strides

    settings_override(small_tiles=False)
    seen = {}
    for shape, stored in [((64, 512, 4096), (64, 512, 1)), ((8, 4096, 4096), (8, 4096, 1)),
                          ((8, 4096, 4096), (1, 4096, 4096))]:
        x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        mask = torch.empty(stored, dtype=torch.bool, device="meta").expand(shape)
        sx, sm = _strides(x, shape, 1), _strides(mask, shape, 1)
        _, cx, _ = K.launch_config(shape[1], 1, shape[0], shape[2], sx, sm, None, 2, False, 132)
        seen[shape, stored] = (cx["COMPACT"], cx["BLOCK_R"] == 1, cx["PDL"])
    assert list(seen.values()) == [(True, True, True), (True, False, False), (False, False, False)], seen
    # row tiles over listed rows, asked for; not granted on a CPU tensor
    from torch_fused.ops import mask_reduce as M

    x = torch.zeros(2048, 64, 8)
    mask = torch.ones(2048, 64, 1, dtype=torch.bool).expand(2048, 64, 8)
    _, cx, _ = K.launch_config(64, 1, 2048, 8, _strides(x, x.shape, 1), _strides(mask, x.shape, 1), None, 4, False,
                               M.n_sm(x.device))
    assert cx["COMPACT"] and cx["PDL"]
    plan = M._plan(x, 1, mask, None, None)
    assert plan[5].constexprs["PDL"] is False and "launch_pdl" not in plan[5].constexprs
    assert plan[6][1].constexprs["PDL"] is False


@pytest.mark.parametrize("device", DEVICES)
def test_checks_run_for_every_new_call_key(device):
    """The implementation keeps a plan per call key (shapes, strides, dtypes, devices, dim): a
    call whose key has no plan yet is checked, even after calls of good input of the same shapes."""
    x = torch.randn(3, 5, 7, device=device)
    torch_fused.mask_reduce(x, 1)
    torch_fused.mask_reduce(x, 1, torch.ones(3, 5, 7, dtype=torch.bool, device=device))
    with pytest.raises(RuntimeError, match="mask: expected a bool, integer or floating dtype"):
        torch.ops.fused.mask_reduce(x, 1, torch.ones(3, 5, 7, dtype=torch.complex64, device=device))
    with pytest.raises(RuntimeError, match="dim: expected a dim of x"):
        torch.ops.fused.mask_reduce(x, 3)
    with pytest.raises(RuntimeError, match="dim: expected an int, got float"):  # equal to the 1 of a plan
        torch_fused.mask_reduce(x, 1.0)
    with pytest.raises(RuntimeError, match=r"mask: shape \(3, 4, 7\) does not broadcast"):
        torch.ops.fused.mask_reduce(x, 1, torch.ones(3, 4, 7, dtype=torch.bool, device=device))


def test_tile_sweep_reaches_every_case(settings_override):
    """python -m torch_fused.bench --sweep --only mask_reduce: each of its cases (the bench's
    8x4096x4096 masks, on a 132-SM device) launches with different tiles at different sweep
    points, so no case's row of the sweep times one tile choice over and over (a row mask's
    strips read their own TILES entries, which its sweep points set), and every point of the
    row mask's grid launches differently."""
    from torch_fused.bench.mask_reduce import ROW_MASK_SWEEP_GRID, SWEEP_CASES, sweep_points
    from torch_fused.kernels import mask_reduce as K
    from torch_fused.ops.mask_reduce import _strides

    settings_override(small_tiles=False)
    for shape, pattern in SWEEP_CASES:
        x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        stored = shape if pattern == "full" else [1 if n == "1" else s for n, s in zip(pattern.split()[:3], shape)]
        mask = torch.empty(stored, dtype=torch.bool, device="meta").expand(shape)
        sx, sm = _strides(x, shape, 1), _strides(mask, shape, 1)
        seen = {}
        for point in sweep_points(pattern):
            assert set(point) <= set(K.TILES), point
            with torch_fused.settings.override(mask_reduce_tiles={**K.TILES, **point}):
                n_iblk, cx, warps = K.launch_config(shape[1], 1, shape[0], shape[2], sx, sm, None, 2, False, 132)
            seen.setdefault(tuple(sorted(point.items())), (n_iblk, warps, tuple(sorted(cx.items()))))
        assert len(set(seen.values())) > 1, pattern
        if pattern == "B M 1 expanded":  # each swept entry reaches the launch; listed rows or not
            assert {dict(c[2])["COMPACT"] for c in seen.values()} == {False, True}
            for key in ROW_MASK_SWEEP_GRID:
                by_rest = {}
                for point, launch in seen.items():
                    rest = tuple(kv for kv in point if kv[0] != key)
                    by_rest.setdefault(rest, set()).add(launch)
                assert any(len(v) > 1 for v in by_rest.values()), key
