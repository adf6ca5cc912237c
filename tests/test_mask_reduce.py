"""fused::mask_reduce and the helpers built on it (CPU reference path, the interpreter run, and
CUDA on the device)."""

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
        mask=draw(st.sampled_from([None, "bool", "int"])), mpat=pattern(),
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
        mk = (lambda s: torch.rand(s, generator=gen) < 0.6) if c["mask"] == "bool" else \
             (lambda s: torch.randint(0, 3, s, generator=gen, dtype=torch.int32))
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


SHIPPED_TILE_CASES = [
    # (x shape, dtype, dim, mask storage shape or None, scale storage shape or None): each hits
    # one branch of kernels.mask_reduce.pick_blocks with n_sm=1
    ((300, 3, 1000), torch.bfloat16, 1, (300, 3, 1000), None),  # many outputs, R < BLOCK_R
    ((1, 300, 200), torch.float32, 1, (1, 300, 200), None),  # few outputs: strips, tall tiles, tail
    ((5, 3000), torch.bfloat16, -1, (5, 3000), (1, 3000)),  # reduce dim contiguous
    ((50, 4, 700), torch.float16, 1, (50, 4, 1), (1, 1, 700)),  # [B, M, 1] mask: predicated x
]


@pytest.mark.skipif(not INTERPRET, reason="the shipped tiles run as-is on CUDA; here through the interpreter")
@pytest.mark.parametrize("case", SHIPPED_TILE_CASES, ids=lambda c: "x".join(map(str, c[0])) if isinstance(c, tuple) else None)
def test_shipped_tile_configs_match_reference(case, monkeypatch):
    """The suite runs the interpreter with tiny tiles; this runs the tiles the picker ships
    (software-pipelined loop, several rows per thread, masked tails) on small shapes."""
    from torch_fused.kernels import mask_reduce as K

    shape, dtype, dim, mshape, sshape = case
    monkeypatch.setattr(K, "pick_blocks", lambda r, i, n_outer, rc, xb, n_sm: K._shipped_pick_blocks(r, i, n_outer, rc, xb, 1))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = (torch.rand(mshape, generator=gen) < 0.6).expand(shape) if mshape else None
    scale = torch.rand(sshape, generator=gen, dtype=torch.float64).expand(shape) if sshape else None
    if mask is not None:  # masked-off x is NaN: it must not reach y
        x = torch.where(mask, x, torch.full((), float("nan"), dtype=torch.float64))
    xn = x.to(dtype)
    y = torch_fused.mask_reduce(xn, dim, mask, None if scale is None else scale.float(), out_dtype=torch.float32)
    v = xn.double() * (scale if scale is not None else 1.0)
    if mask is not None:
        v = torch.where(mask, v, torch.zeros((), dtype=torch.float64))
    ref = v.sum(dim)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


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
    assert torch.autograd.gradcheck(lambda t: torch_fused.mask_reduce(t, 1, m, s), (x,))


def test_compile_fullgraph_mask_reduce_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")

    def combine(h, keep, w):  # MoE combine: [T, k, H] under a [T, k, 1] keep-mask
        return torch_fused.mask_reduce(h, 1, keep.expand_as(h), w.unsqueeze(-1)).float().pow(2).mean()

    f = torch.compile(combine, fullgraph=True, backend=cnt, dynamic=True)
    for t in (5, 9, 13):
        h = torch.randn(t, 2, 16, requires_grad=True)
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
    (lambda: (torch.zeros(3, 4), 1, torch.ones(3, 5, dtype=torch.bool), None), r"mask: shape \(3, 5\) does not broadcast"),
    (lambda: (torch.zeros(3, 4), 1, torch.ones(3, 4), None), r"mask: expected a bool or integer dtype"),
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


def test_mask_reduce_cost_counts_stored_elements():
    x = torch.randn(6, 4, 10, dtype=torch.bfloat16)
    keep = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)[:, None, None].expand(6, 4, 10)
    c = torch_fused.mask_reduce_cost(x, 1, keep)
    assert c["elements"] == 240 and c["mask_stored"] == 6
    assert c["kept"] == 3 * 4 * 10 and c["adds"] == 120 and c["loads"] == 126
    assert c["floor_bytes"] == 240 * 2 + 6 + 6 * 10 * 2
    assert c["bytes"] == 120 * 2 + 6 + 120
    assert c["materialized_mask_bytes"] == 240


def test_masked_mean_and_aggregate_loss():
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.4
    mask[2] = False  # an empty row
    m = mask.double()
    ld = loss.double()
    s, n = (ld * m).sum(1), m.sum(1)
    torch.testing.assert_close(torch_fused.masked_mean(loss, mask).double(), (ld * m).sum() / m.sum(), rtol=1e-6, atol=1e-7)
    mm = torch_fused.masked_mean(loss, mask, dim=1)
    assert mm[2].item() == 0 and bool(torch.isfinite(mm).all())
    torch.testing.assert_close(mm[[0, 1, 3]].double(), (s / n)[[0, 1, 3]], rtol=1e-6, atol=1e-7)
    agg = lambda mode: torch_fused.aggregate_loss(loss, mask, mode).double()  # noqa: E731
    torch.testing.assert_close(agg("token-mean"), s.sum() / n.sum(), rtol=1e-6, atol=1e-7)
    keep = n > 0
    torch.testing.assert_close(agg("seq-mean-token-mean"), (s[keep] / n[keep]).mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(agg("seq-mean-token-sum"), s.mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(agg("seq-mean-token-sum-norm"), s.sum() / 6, rtol=1e-6, atol=1e-7)
    z = torch.zeros(4, 6, dtype=torch.bool)
    for mode in torch_fused.masked.AGG_MODES:
        assert torch_fused.aggregate_loss(loss, z, mode).item() == 0
    with pytest.raises(ValueError, match="mode: expected one of"):
        torch_fused.aggregate_loss(loss, mask, "mean")


@pytest.mark.skipif(INTERPRET, reason="a gigabyte-scale logical size is for the CPU reference run")
def test_broadcast_mask_is_never_materialized():
    """Logical mask of 1 GiB (and x of 4 GiB logical), stored in kilobytes: the op and its cost
    model must finish with extra memory far below the logical size (peak RSS of a fresh process)."""
    code = textwrap.dedent("""
        import resource, torch, torch_fused
        T, K, H = 1024, 64, 16384
        keep = (torch.rand(T, K, 1) > 0.5)
        mask = keep.expand(T, K, H)                      # 1 GiB logical, 64 KiB stored
        x = torch.randn(1, K, H).expand(T, K, H)         # 4 GiB logical (fp32), 4 MiB stored
        y0 = torch.empty(T, H)                           # the output's size, touched
        y0.fill_(0)
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
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    extra, logical = map(int, proc.stdout.split())
    assert extra < logical / 8, f"peak extra {extra / 2**20:.0f} MiB for a {logical / 2**20:.0f} MiB logical mask"
