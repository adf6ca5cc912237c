"""Vocab-parallel distillation: torch_fused.distill and linear_distill on DTensors sharded over the
vocabulary (torch_fused/parallel_distill.py).

Gloo on CPU, world sizes 2 and 3 (V = 37 splits unevenly; V = 4 over 3 ranks leaves one rank an
empty shard), one process group per world size running every check (tests/_distributed.py).
Every rank compares with the single-device function on the whole tensors, computed in the same
process: the divergence (and entropy), its gradients (the student logits' Shard(-1) shard; d
hidden, the d weight and d bias shards), the outputs' Replicate() placement, and what the
collectives carry: beta 0 / 1 ONE all-gather of rows * (5 [+1 entropy]) forward; the JSD an
all-gather of rows * (4 [+1]) and an all-reduce of rows * 2; backward nothing from logits, one
all-reduce of N * H from heads. Cases: beta 0, 0.5, 1 (and 0.3) with temperature and
ignore_index labels, shift, reduction "none" / "token-mean" / "sum", heads of different hidden
sizes with biases and a softcap, a top-k teacher with both tails; mismatched layouts raise
errors naming the argument.

Under TRITON_INTERPRET=1 one small JSD case from logits runs through the real kernels (the slice
passes and the backward kernel on each rank's shard) at world size 2.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from torch_fused._library import INTERPRET
from torch_fused.collectives import CollectiveCounter
from _distributed import Checks
from _helpers import DEVICES, assert_grad_close
from test_distill import ref_divergence  # TRL's definitions, float64

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

WORLDS = [2, pytest.param(3, marks=pytest.mark.skipif(
    INTERPRET, reason="the plain CPU run covers world size 3 (uneven and empty shards)"))]

CHECKS = Checks(__name__, interpret=False, preload=["torch_fused.parallel", "torch_fused.parallel_distill"],
                timeout_s=240,
                plain_only="the distributed logic is the same code on both paths: the plain CPU run covers it; the "
                           "interpreter run keeps one logits case through the kernels")
check = CHECKS.check

# |out - single device| <= FWD * (|ref| + 1 + ln V) (twice test_distill's fp32 bound: both are within
# it of float64); gradients norm-wise relative to the single-device gradient's norm
FWD = {torch.bfloat16: 4e-6, torch.float32: 4e-6, torch.float64: 2e-12}  # fp32 outputs for bf16 inputs
GRAD = {torch.bfloat16: 1.6e-2, torch.float32: 8e-6, torch.float64: 2e-10}


def _split(v, world):
    """torch.chunk's split, written here independently of torch_fused.parallel."""
    step = -(-v // world)
    return [(min(r * step, v), min(v, (r + 1) * step)) for r in range(world)]


def _close(out, ref, v, dtype, what):
    out, ref = out.detach().double(), ref.detach().double()
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    err = (out - ref).abs()
    bound = FWD[dtype] * (ref.abs() + 1 + math.log(v))
    assert bool((err <= bound).all()), f"{what}: worst {err.max().item():.3g} (bound {bound.min().item():.3g}+)"


def _grad_close(g, ref, dtype, what, scale=1.0):
    g, ref = g.detach().double(), ref.detach().double()
    assert g.shape == ref.shape, (what, g.shape, ref.shape)
    err = (g - ref).norm().item()
    assert err <= GRAD[dtype] * ref.norm().item() + 1e-7 * scale, (what, err, ref.norm().item())


def _loss(div, g):
    """A loss of the output (per-token weights g, or the 0-dim reduced value)."""
    return (div.double() * g).sum() if div.dim() else div.double() * 1.7


def _replicated(o, mesh_size):
    from torch.distributed.tensor import DTensor, Replicate

    assert isinstance(o, DTensor) and o.placements == (Replicate(),) * mesh_size, (type(o), getattr(o, "placements", 0))


def _counts(beta, n, ent):
    """The forward's collectives: (op, elements) in order."""
    if beta in (0.0, 1.0):
        return [("all_gather_into_tensor", n * (5 + ent))]
    return [("all_gather_into_tensor", n * (4 + ent)), ("all_reduce", n * 2)]


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
LOGIT_CASES = [
    # beta, V, dtype, T, shift, reduction, return_entropy
    (0.0, 37, torch.float32, 0.7, False, "none", True),
    (0.5, 37, torch.float32, 1.3, True, "none", True),
    (1.0, 37, torch.float32, 0.9, False, "token-mean", False),
    (0.3, 37, torch.float64, 1.0, True, "sum", True),
    (1.0, 4, torch.float32, 1.0, False, "none", True),  # world 3: shards of 2, 2, 0 columns
    (0.5, 4, torch.float32, 0.8, False, "none", False),
    (0.5, 37, torch.bfloat16, 0.8, True, "none", True),  # d logits rounded once to bf16
]
INTERPRET_CASES = [1]  # the JSD: both slice passes and the backward kernel
# a padded vocabulary: both models' last shard all -inf in two rows (a slice without probability)
MASKED_CASES = {0, 1, 2}


@check(interpret=True, worlds=(2, 3))
def logits_forms(ctx):
    import torch_fused
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for i, (beta, v, dtype, t, shift, red, want_ent) in enumerate(LOGIT_CASES):
        if INTERPRET and i not in INTERPRET_CASES:
            continue
        label = f"logits case {i}: beta={beta} V={v} {dtype} T={t} shift={shift} {red} entropy={want_ent}"
        g = torch.Generator().manual_seed(10 + i)
        b, l = 2, 4
        xs_full = (torch.randn(b, l + shift, v, generator=g, dtype=torch.float64) * 2).to(dtype)
        xt_full = (torch.randn(b, l + shift, v, generator=g, dtype=torch.float64) * 2).to(dtype)
        if i in MASKED_CASES:
            lo, hi = _split(v, ctx.world)[-1]
            xs_full[:, :2, lo:hi] = float("-inf")
            xt_full[:, :2, lo:hi] = float("-inf")
        labels = torch.randint(0, v, (b, l), generator=g)
        labels[0, 1] = -100
        labels[1, 3] = -100
        kw = dict(beta=beta, temperature=t, labels=labels, shift=shift, reduction=red, return_entropy=want_ent)
        xs = distribute_tensor(xs_full, ctx.mesh, [Shard(-1)]).requires_grad_(True)
        xt = distribute_tensor(xt_full, ctx.mesh, [Shard(-1)])
        with CollectiveCounter() as fwd:
            out = torch_fused.distill(xs, xt, **kw)
        ref_x = xs_full.clone().requires_grad_(True)
        ref = torch_fused.distill(ref_x, xt_full.clone(), **kw)
        div, ent = out if want_ent else (out, None)
        rdiv, rent = ref if want_ent else (ref, None)
        gw = torch.randn(b, l, generator=g, dtype=torch.float64)
        with CollectiveCounter() as bwd:
            _loss(div.to_local(), gw).backward()
        _loss(rdiv, gw).backward()
        with ctx.soft(label + " placements and collectives"):
            _replicated(div, 1)
            if want_ent:
                _replicated(ent, 1)
            assert isinstance(xs.grad, DTensor) and xs.grad.placements == xs.placements and xs.grad.shape == xs.shape
            assert fwd == _counts(beta, b * l, want_ent), fwd
            assert bwd == [], bwd
        with ctx.soft(label + " values"):
            _close(div.to_local(), rdiv, v, dtype, "divergence")
            if want_ent:
                _close(ent.to_local(), rent, v, dtype, "entropy")
            if red == "none":
                assert bool((div.to_local()[0, 1] == 0).all()) and bool((div.to_local()[1, 3] == 0).all())
        with ctx.soft(label + " gradient"):
            a, c = _split(v, ctx.world)[ctx.rank]
            _grad_close(xs.grad.to_local(), ref_x.grad[..., a:c], dtype, "d student logits shard")
    if not INTERPRET:  # the student's last shard all -inf where the teacher's is not: KL(t || s) = inf
        g = torch.Generator().manual_seed(30)
        xs_full, xt_full = torch.randn(2, 3, 37, generator=g), torch.randn(2, 3, 37, generator=g)
        lo, hi = _split(37, ctx.world)[-1]
        xs_full[0, :, lo:hi] = float("-inf")
        for beta in (0.0, 1.0, 0.5):
            with ctx.soft(f"student without probability on a shard, beta={beta}"):
                out = torch_fused.distill(distribute_tensor(xs_full, ctx.mesh, [Shard(-1)]),
                                          distribute_tensor(xt_full, ctx.mesh, [Shard(-1)]), beta=beta).to_local()
                ref = torch_fused.distill(xs_full, xt_full, beta=beta)
                assert torch.equal(torch.isinf(out), torch.isinf(ref)) and bool(torch.isinf(ref).any()) == (beta == 0)
                fin = torch.isfinite(ref)
                _close(out[fin], ref[fin], 37, torch.float32, "divergence")
    ctx.done()


HEAD_CASES = [
    # beta, V, T, shift, reduction, biases, student softcap, hidden as Replicate DTensors, dtype
    (0.0, 37, 0.8, True, "none", True, None, False, torch.float32),
    (0.5, 37, 1.0, False, "none", True, 5.0, True, torch.float32),
    (1.0, 37, 1.2, False, "token-mean", False, None, False, torch.float32),
    (0.5, 4, 1.0, True, "sum", True, None, False, torch.float32),  # world 3: an empty weight shard
    (1.0, 37, 1.0, False, "none", True, None, False, torch.bfloat16),
]


@check(worlds=(2, 3))
def head_forms(ctx):
    import torch_fused
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for i, (beta, v, t, shift, red, has_bias, cap, h_dtensor, dtype) in enumerate(HEAD_CASES):
        label = f"head case {i}: beta={beta} V={v} T={t} shift={shift} {red} bias={has_bias} softcap={cap} {dtype}"
        g = torch.Generator().manual_seed(40 + i)
        b, l, hs, ht = 2, 4, 8, 12  # the teacher is wider
        shf = torch.randn(b, l + shift, hs, generator=g).to(dtype)
        thf = torch.randn(b, l + shift, ht, generator=g).to(dtype)
        swf = (torch.randn(v, hs, generator=g) / hs**0.5 * 2).to(dtype)
        twf = (torch.randn(v, ht, generator=g) / ht**0.5 * 2).to(dtype)
        sbf = torch.randn(v, generator=g).to(dtype) if has_bias else None
        tbf = torch.randn(v, generator=g).to(dtype) if has_bias else None
        labels = torch.randint(0, v, (b, l), generator=g)
        labels[1, 0] = -100
        kw = dict(beta=beta, temperature=t, labels=labels, shift=shift, reduction=red, return_entropy=True,
                  student_softcap=cap, teacher_logit_scale=0.9)

        def dist(x, pl):
            return None if x is None else distribute_tensor(x, ctx.mesh, pl)

        sw = dist(swf, [Shard(0)]).requires_grad_(True)
        sb = dist(sbf, [Shard(0)]).requires_grad_(True) if has_bias else None
        sh = (dist(shf, [Replicate()]) if h_dtensor else shf.clone()).requires_grad_(True)
        th = dist(thf, [Replicate()]) if h_dtensor else thf
        tw, tb = dist(twf, [Shard(0)]), dist(tbf, [Shard(0)])
        with CollectiveCounter() as fwd:
            div, ent = torch_fused.linear_distill(sh, sw, th, tw, student_bias=sb, teacher_bias=tb, **kw)
        rh, rw = shf.clone().requires_grad_(True), swf.clone().requires_grad_(True)
        rb = sbf.clone().requires_grad_(True) if has_bias else None
        rdiv, rent = torch_fused.linear_distill(rh, rw, thf, twf, student_bias=rb, teacher_bias=tbf, **kw)
        gw = torch.randn(b, l, generator=g, dtype=torch.float64)
        with CollectiveCounter() as bwd:
            _loss(div.to_local(), gw).backward()
        _loss(rdiv, gw).backward()
        with ctx.soft(label + " placements and collectives"):
            _replicated(div, 1)
            _replicated(ent, 1)
            assert isinstance(sw.grad, DTensor) and sw.grad.placements == (Shard(0),) and sw.grad.shape == swf.shape
            if has_bias:
                assert sb.grad.placements == (Shard(0),) and sb.grad.shape == sbf.shape
            if h_dtensor:
                assert sh.grad.placements == (Replicate(),), sh.grad.placements
            assert fwd == _counts(beta, b * l, True), fwd
            assert bwd == [("all_reduce", b * l * hs)], bwd  # the scored rows' d hidden, once
        with ctx.soft(label + " values"):
            _close(div.to_local(), rdiv, v, torch.float32, "divergence")
            _close(ent.to_local(), rent, v, torch.float32, "entropy")
        a, c = _split(v, ctx.world)[ctx.rank]
        with ctx.soft(label + " gradients"):
            dh = sh.grad.to_local() if h_dtensor else sh.grad
            assert dh.dtype == dtype and sw.grad.dtype == dtype, (dh.dtype, sw.grad.dtype)
            _grad_close(dh, rh.grad, dtype, "d student hidden")
            _grad_close(sw.grad.to_local(), rw.grad[a:c], dtype, "d student weight shard")
            if has_bias:
                _grad_close(sb.grad.to_local(), rb.grad[a:c], dtype, "d student bias shard")
            if shift:
                assert bool((dh[:, -1] == 0).all())
    ctx.done()


@check(worlds=(2, 3))
def topk_forms(ctx):
    """The student's head sharded, the teacher's top-k given (plain tensors): logits and head."""
    import torch_fused
    from torch.distributed.tensor import Shard, distribute_tensor

    b, l, v, k, hd = 2, 4, 37, 5, 8
    for i, (form, beta, tail, red, t) in enumerate([("logits", 0.5, "bucket", "none", 0.8),
                                                    ("logits", 1.0, "renormalize", "token-mean", 1.0),
                                                    ("head", 0.0, "renormalize", "none", 1.1),
                                                    ("head", 0.5, "bucket", "sum", 1.0)]):
        label = f"top-k case {i}: {form} beta={beta} tail={tail} {red} T={t}"
        g = torch.Generator().manual_seed(70 + i)
        ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(b * l)]).view(b, l, k)
        tlp = torch.log_softmax(torch.randn(b, l, v, generator=g), -1).gather(-1, ids)
        tlp[0, 2, 1] = float("-inf")  # an unused slot
        ids[1, 1, 0] = -100  # another
        labels = torch.randint(0, v, (b, l), generator=g)
        labels[0, 0] = -100
        kw = dict(teacher_topk_ids=ids, teacher_topk_logprobs=tlp, beta=beta, temperature=t, labels=labels,
                  reduction=red, tail=tail, return_entropy=True)
        gw = torch.randn(b, l, generator=g, dtype=torch.float64)
        if form == "logits":
            full = torch.randn(b, l, v, generator=g) * 2
            x = distribute_tensor(full, ctx.mesh, [Shard(-1)]).requires_grad_(True)
            rx = full.clone().requires_grad_(True)
            div, ent = torch_fused.distill(x, **kw)
            rdiv, rent = torch_fused.distill(rx, **kw)
            got, want = [x], [rx]
        else:
            hf, wf = torch.randn(b, l, hd, generator=g), torch.randn(v, hd, generator=g)
            bf = torch.randn(v, generator=g)
            h = hf.clone().requires_grad_(True)
            w = distribute_tensor(wf, ctx.mesh, [Shard(0)]).requires_grad_(True)
            bias = distribute_tensor(bf, ctx.mesh, [Shard(0)]).requires_grad_(True)
            rh, rw, rb = (u.clone().requires_grad_(True) for u in (hf, wf, bf))
            div, ent = torch_fused.linear_distill(h, w, student_bias=bias, **kw)
            rdiv, rent = torch_fused.linear_distill(rh, rw, student_bias=rb, **kw)
            got, want = [h, w, bias], [rh, rw, rb]
        _loss(div.to_local(), gw).backward()
        _loss(rdiv, gw).backward()
        a, c = _split(v, ctx.world)[ctx.rank]
        with ctx.soft(label + " values"):
            _replicated(div, 1)
            _close(div.to_local(), rdiv, v, torch.float32, "divergence")
            _close(ent.to_local(), rent, v, torch.float32, "entropy")
        with ctx.soft(label + " gradients"):
            for j, (p, rp) in enumerate(zip(got, want)):
                gr = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if form == "logits":
                    sl = rp.grad[..., a:c]  # the student logits' shard
                else:
                    sl = rp.grad if j == 0 else rp.grad[a:c]  # d hidden whole; d weight, d bias shards
                _grad_close(gr, sl, torch.float32, f"gradient {tuple(rp.shape)}")
    ctx.done()


@check(worlds=(2,))
def mismatched_layouts_fail_clearly(ctx):
    import torch_fused
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(5)
    xs_full, xt_full = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    xs = distribute_tensor(xs_full, ctx.mesh, [Shard(-1)])
    mesh2 = init_device_mesh("cpu", (1, ctx.world))
    cases = [
        ("plain teacher", lambda: torch_fused.distill(xs, xt_full), "teacher_logits: expected a DTensor placed as"),
        ("replicated teacher", lambda: torch_fused.distill(xs, distribute_tensor(xt_full, ctx.mesh, [Replicate()])),
         r"teacher_logits: expected the placements of student_logits"),
        ("teacher on another mesh", lambda: torch_fused.distill(xs, distribute_tensor(xt_full, mesh2,
                                                                                      [Replicate(), Shard(-1)])),
         "teacher_logits: expected a DTensor on the mesh of student_logits"),
        ("teacher vocabulary", lambda: torch_fused.distill(
            xs, distribute_tensor(torch.randn(2, 3, 12, generator=g), ctx.mesh, [Shard(-1)])),
         "teacher_logits: vocabulary size 12"),
        ("plain student", lambda: torch_fused.distill(xs_full, distribute_tensor(xt_full, ctx.mesh, [Shard(-1)])),
         "student_logits: expected a DTensor with placement Shard"),
        ("student sharded on rows", lambda: torch_fused.distill(distribute_tensor(xs_full, ctx.mesh, [Shard(1)]),
                                                                distribute_tensor(xt_full, ctx.mesh, [Shard(1)])),
         r"student_logits: expected placement Shard\(-1\)"),
    ]
    h, ht = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 6, generator=g)
    w = distribute_tensor(torch.randn(11, 4, generator=g), ctx.mesh, [Shard(0)])
    wt_full = torch.randn(11, 6, generator=g)
    wt = distribute_tensor(wt_full, ctx.mesh, [Shard(0)])
    cases += [
        ("plain teacher weight", lambda: torch_fused.linear_distill(h, w, ht, wt_full),
         "teacher_weight: expected a DTensor placed as student_weight"),
        ("teacher weight sharded on H", lambda: torch_fused.linear_distill(
            h, w, ht, distribute_tensor(wt_full, ctx.mesh, [Shard(1)])),
         "teacher_weight: expected the placements of student_weight"),
        ("teacher weight vocabulary", lambda: torch_fused.linear_distill(
            h, w, ht, distribute_tensor(torch.randn(12, 6, generator=g), ctx.mesh, [Shard(0)])),
         "teacher_weight: vocabulary size 12"),
        ("plain student bias", lambda: torch_fused.linear_distill(h, w, ht, wt, student_bias=torch.zeros(11)),
         "student_bias: expected a DTensor placed as student_weight"),
        ("plain student weight", lambda: torch_fused.linear_distill(h, w.full_tensor(), ht, wt),
         "student_weight: expected a DTensor with placement Shard"),
        ("mesh_dim with plain tensors", lambda: torch_fused.distill(xs_full, xt_full, mesh_dim=0), "mesh_dim: only"),
    ]
    for name, fn, match in cases:
        with ctx.soft(name):
            # a vocabulary that differs is the single-device shape check's RuntimeError; layouts ValueError
            with pytest.raises(RuntimeError if "vocabulary size" in match else ValueError, match=match):
                fn()
    ctx.done()


# ---------------------------------------------------------------------------------------------
# The rank-local pieces, without a process group (CPU, and CUDA where the shifts are rounded)
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(INTERPRET, reason="the interpreter shifts exactly, as the plain CPU run does")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_slice_pieces_large_logits(device, beta):
    """What the ranks compute, run here slice after slice: each slice's single-device forward (a
    plain KL) or statistics pass (the JSD), the merge of all slices' partials (what every rank does
    with the all-gather's output), the JSD's divergence pass per slice summed (the all-reduce),
    and each slice's backward with the merged statistics. Logits near 1e4 with an O(1) spread:
    the slices' shifts must be differenced as the kernels form them (rounded products of m c on
    the GPU); divergence and entropy within 1e-4 nats of float64, d logits to fp32 accuracy. On
    CUDA this is the only test of that path."""
    from torch_fused import parallel as P
    from torch_fused import parallel_distill as PD
    from torch_fused._library import LOG2E
    from torch_fused.meta.distill import DistillOptions

    gen = torch.Generator().manual_seed(3)
    v, t, n = 5000, 0.7, 6
    starts, sizes = P.chunk_split(v, 3)
    xs64 = 1e4 + 3 * torch.randn(2, 3, v, generator=gen, dtype=torch.float64)
    xt64 = 1e4 + 0.5 + 3 * torch.randn(2, 3, v, generator=gen, dtype=torch.float64)
    xs, xt = xs64.float().to(device), xt64.float().to(device)
    lab = torch.zeros(2, 3, dtype=torch.long, device=device)
    lab[1, 2] = -100
    opts = DistillOptions(beta=beta, temperature=t, compute_entropy=True)
    c = LOG2E / t
    exact = PD._exact(xs, xt, c, c)
    slices = [(xs[..., s:s + k], xt[..., s:s + k]) for s, k in zip(starts, sizes)]
    dt = torch.float32
    if opts.mode != 2:
        parts = torch.stack([PD.slice_parts(st, ent, div, n, dt) for div, ent, st in
                             (torch.ops.fused._distill_forward(a, b, lab, *opts.values()) for a, b in slices)])
        div, ent, stats = PD._finish_world(parts, n, c, c, exact, True, opts.mode, lab, opts, dt, xs.device)
    else:
        parts = torch.stack([PD.slice_parts(st, ent, None, n, dt) for _, ent, st in
                             (torch.ops.fused._distill_slice_forward(a, b, lab, None, *opts.values())
                              for a, b in slices)])
        _, ent, stats = PD._finish_world(parts, n, c, c, exact, True, None, lab, opts, dt, xs.device)
        sums = sum(torch.stack([d.reshape(n), st.reshape(n, 5)[:, 4]], 1) for d, _, st in
                   (torch.ops.fused._distill_slice_forward(a, b, lab, stats.reshape(2, 3, 5), *opts.values())
                    for a, b in slices))
        div = sums[:, 0]
        stats[:, 4] = sums[:, 1]
    xr = xs64.float().double().requires_grad_(True)
    rdiv = ref_divergence(xr / t, xt64.float().double() / t, beta) * (lab.cpu() != -100)
    rent = -(torch.log_softmax(xr / t, -1).exp() * torch.log_softmax(xr / t, -1)).sum(-1)
    assert (div.reshape(2, 3).double().cpu() - rdiv).abs().max().item() <= 1e-4, "divergence"
    assert (ent.reshape(2, 3).double().cpu() - rent).abs().max().item() <= 1e-4, "entropy"
    g = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    dx = torch.cat([torch.ops.fused._distill_backward(g.float().to(device), a, b, lab, stats.reshape(2, 3, 5),
                                                      *opts.values()) for a, b in slices], -1)
    (rdx,) = torch.autograd.grad((rdiv * g).sum(), xr)
    assert_grad_close(dx, rdx, g.abs()[..., None] / t, torch.float32, "d student logits")


@pytest.mark.parametrize("device", DEVICES)
def test_slice_ops_opcheck(device):
    """The slice ops' registrations (fakes, schemas, no autograd of their own): torch.library.opcheck."""
    if INTERPRET:
        pytest.skip("plain CPU (on CUDA the kernels' implementations)")
    from torch_fused.meta.distill import DistillOptions

    gen = torch.Generator().manual_seed(4)
    ops = torch.ops.fused
    s, t = torch.randn(2, 5, 13, generator=gen).to(device), torch.randn(2, 5, 13, generator=gen).to(device)
    lab = torch.tensor([[1, -100, 2, 3], [4, 5, -100, 6]], device=device)
    sh, sw = torch.randn(2, 5, 8, generator=gen).to(device), torch.randn(13, 8, generator=gen).to(device)
    sb = torch.randn(13, generator=gen).to(device)
    th, tw = torch.randn(2, 5, 6, generator=gen).to(device), torch.randn(13, 6, generator=gen).to(device)
    for want_ent in (True, False):
        opts = DistillOptions(beta=0.4, shift=True, compute_entropy=want_ent, student_softcap=None)
        _, _, st = ops._distill_slice_forward(s, t, lab, None, *opts.values())
        for stats in (None, st):
            torch.library.opcheck(ops._distill_slice_forward, (s, t, lab, stats, *opts.values()))
        hopts = DistillOptions(beta=0.4, shift=True, compute_entropy=want_ent, student_softcap=4.0)
        _, _, hst = ops._linear_distill_slice_forward(sh, sw, sb, th, tw, None, lab, None, *hopts.values())
        for stats in (None, hst):
            torch.library.opcheck(ops._linear_distill_slice_forward, (sh, sw, sb, th, tw, None, lab, stats,
                                                                      *hopts.values()))
    g = torch.randn(2, 4, generator=gen).to(device)
    for flags in ((True, True, True), (True, False, False)):
        torch.library.opcheck(ops._linear_distill_slice_backward, (g, sh, sw, sb, th, tw, None, lab, hst,
                                                                   *hopts.values()),
                              dict(zip(("hidden_grad", "weight_grad", "bias_grad"), flags)))
    with pytest.raises(RuntimeError, match=r"stats: expected the whole rows' statistics \(2, 4, 5\)"):
        ops._distill_slice_forward(s, t, lab, st[:, :3], *opts.values())


def _compiled_fullgraph(ctx, device, backend):
    """torch.compile(fullgraph=True) of both forms (a plain KL and the JSD, reduced losses) equal to
    eager, gradients placed as eager's. Not in the gloo group (tracing takes ~20 s on CPU): the
    CUDA test below runs it on a one-rank NCCL group."""
    import torch_fused
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(12)
    xs, xt = torch.randn(2, 5, 23, generator=g).to(device), torch.randn(2, 5, 23, generator=g).to(device)
    lab = torch.randint(0, 23, (2, 4), generator=g).to(device)
    lab[0, 1] = -100
    w, wt = torch.randn(23, 8, generator=g).to(device), torch.randn(23, 6, generator=g).to(device)
    h, ht = torch.randn(2, 5, 8, generator=g).to(device), torch.randn(2, 5, 6, generator=g).to(device)

    def loss(x, y, sw, tw, hh, beta):
        a = torch_fused.distill(x, y, beta=beta, labels=lab, shift=True, reduction="token-mean")
        b = torch_fused.linear_distill(hh, sw, ht, tw, beta=beta, labels=lab, shift=True, reduction="sum")
        return a.to_local() + b.to_local()

    for beta in (0.0, 0.5):
        torch._dynamo.reset()
        outs = []
        for fn in (loss, torch.compile(loss, backend=backend, fullgraph=True)):
            x = distribute_tensor(xs, ctx.mesh, [Shard(-1)]).requires_grad_(True)
            sw = distribute_tensor(w, ctx.mesh, [Shard(0)]).requires_grad_(True)
            hh = h.clone().requires_grad_(True)
            value = fn(x, distribute_tensor(xt, ctx.mesh, [Shard(-1)]), sw, distribute_tensor(wt, ctx.mesh, [Shard(0)]),
                       hh, beta)
            value.backward()
            outs.append((value, x.grad, sw.grad, hh.grad))
        (v0, dx0, dw0, dh0), (v1, dx1, dw1, dh1) = outs
        assert dx1.placements == dx0.placements and dw1.placements == dw0.placements
        torch.testing.assert_close(v1, v0)
        torch.testing.assert_close(dx1.to_local(), dx0.to_local())
        torch.testing.assert_close(dw1.to_local(), dw0.to_local())
        torch.testing.assert_close(dh1, dh0)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_on_one_nccl_rank(backend, tmp_path):
    """Both forms compiled (fullgraph) on CUDA through a one-rank NCCL group: equal to eager."""
    from torch.distributed.device_mesh import init_device_mesh

    from _distributed import Ctx

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        _compiled_fullgraph(Ctx(0, 1, init_device_mesh("cuda", (1,))), "cuda", backend)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The group
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def group(request, tmp_path_factory):
    world = request.param
    return world, CHECKS.run_group(world, tmp_path_factory.mktemp(f"distill_parallel_w{world}"))


_assert_check = CHECKS.assert_check


def test_logits_forms(group):
    """distill on Shard(-1) student and teacher logits: beta 0, 0.3, 0.5, 1, temperature, labels,
    shift, each reduction; values and the Shard(-1) gradient equal to one device's; one all-gather
    for a plain KL, an all-gather and an all-reduce for the JSD, no collective backward."""
    _assert_check(group, "logits_forms")


def test_head_forms(group):
    """linear_distill with Shard(0) heads of different hidden sizes (biases, a softcap): values,
    d hidden (one all-reduce of N * H), d weight and d bias shards equal to one device's."""
    _assert_check(group, "head_forms")


def test_topk_forms(group):
    """A top-k teacher with the student's logits or head sharded: both tails, values and
    gradients equal to one device's."""
    _assert_check(group, "topk_forms")


def test_mismatched_layouts_fail_clearly(group):
    _assert_check(group, "mismatched_layouts_fail_clearly")


def test_every_check_has_a_test():
    import sys

    from _distributed import assert_every_check_has_a_test

    assert_every_check_has_a_test(CHECKS, sys.modules[__name__])
