"""Vocab-parallel log-probs, entropy and fused lm_head on DTensors (torch_fused/parallel.py).

Gloo on CPU, world sizes 2 and 3 (uneven splits; V = 4 over 3 ranks leaves one rank an empty
shard), spawned with torch.multiprocessing. Each world size is ONE process group that runs every
check (a fork server preloads torch and torch_fused once, so the ranks start in well under a
second); each check is reported as its own test. Every rank compares with the single-device op
on the whole logits (computed in the same process) and with float64 formulas:

- values of selective_log_softmax / entropy_from_logits / logprobs_and_entropy and the logits'
  gradient across fp32 / bf16 / fp64, temperature, top-K, ignore_index (also inside the
  vocabulary), shift, masked (-inf) vocabulary covering a whole shard, large logits;
- placements: Replicate() outputs, a Shard(-1) gradient of the logits' global shape;
- the fused head with a Shard(0) weight (and bias): values, d hidden, d weight (still Shard(0));
- what the collectives carry, counted by a TorchDispatchMode over the c10d functional ops: the
  forward makes exactly one all-gather of rows * (2 [+1 entropy] [+K]) elements, the logits'
  backward none, the head's backward one all-reduce of N * H;
- clear errors for placements we do not support.

Under TRITON_INTERPRET=1 (the interpreter run) the ranks run the real Triton kernels for their
local work (log-prob forward and backward, the head's chunk merge) on the same small shapes, with
fewer cases.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from torch_fused._library import INTERPRET
from torch_fused.collectives import CollectiveCounter
from _distributed import Checks
from _helpers import DEVICES, FWD_RTOL, assert_grad_close, assert_logprob_close, ref_linear, ref_logprobs_entropy

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

# The interpreter run checks the Triton local work (log-prob forward / backward kernels, the head's
# chunk merge and in-place backward) under the distributed path at world size 2, on fewer cases; the
# distributed logic itself is the same code on both paths and is covered by the plain run.
WORLDS = [2, pytest.param(3, marks=pytest.mark.skipif(
    INTERPRET, reason="the plain CPU run covers world size 3 (uneven and empty shards); the interpreter run "
                      "drives the kernels at world size 2, and the kernels alone are covered by the other tests"))]
GROUP_TIMEOUT_S = 300  # the whole group (all checks); a stuck collective fails the tests, never hangs them

# norm-wise relative error of the head's gradients against float64 (as tests/test_linear_logprobs.py)
HEAD_GRAD_REL = {torch.bfloat16: 8e-3, torch.float32: 4e-6, torch.float64: 1e-10}


# ---------------------------------------------------------------------------------------------
# Checks: run inside every rank of the group
# ---------------------------------------------------------------------------------------------
CHECKS = Checks(__name__, interpret=True, preload=["torch_fused.parallel", "torch._dynamo",
                                                  "torch._functorch.aot_autograd"],
                 timeout_s=GROUP_TIMEOUT_S,
                 plain_only="distributed logic only (placements, meshes, errors, tracing): the plain CPU run covers "
                            "it; the interpreter run keeps to the checks that drive the Triton kernels")
check = CHECKS.check


def _split(v, world):
    """torch.chunk's split, written here independently of torch_fused.parallel."""
    step = -(-v // world)
    return [(min(r * step, v), min(v, (r + 1) * step)) for r in range(world)]


LOGIT_CASES = [
    # fn, V, dtype, T, K, shift, extras
    ("both", 37, torch.float32, 1.0, None, False, {"ignore": True}),
    ("both", 37, torch.bfloat16, 0.7, 2, True, {"ignore": True}),
    ("logp", 37, torch.float32, 0.7, 2, False, {"index_dtensor": True}),
    ("ent", 37, torch.bfloat16, 1.3, None, True, {}),
    ("both", 4, torch.float32, 1.0, None, False, {}),  # world 3: splits 2, 2, 0
    # a padded vocabulary: rows whose last shard is all -inf, logits far below 0 (the empty slice's max
    # must not count), int32 ids
    ("both", 37, torch.float32, 1.0, 2, False, {"mask_last_shard": True, "offset": -1000.0, "int32": True}),
    ("both", 37, torch.float64, 0.9, 2, True, {"ignore_index": 5}),  # ignore_index inside the vocabulary
    # logits near 1e4 with an O(1) spread: the shards' shifts must be differenced as the kernels form them
    ("both", 37, torch.float32, 0.7, None, False, {"offset": 1e4, "at_max": True}),
    ("logp", 37, torch.bfloat16, 1.0, None, True, {}),
]
# the interpreter runs kernels one program at a time in Python: bf16 + top-K + shift, entropy only,
# fp32 with a masked (-inf) shard, logits near 1e4
INTERPRET_CASES = [1, 3, 5, 7]


def _logits_case(ctx, i, case):
    import torch_fused
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    fn, v, dtype, t, k, shift, ex = case
    g = torch.Generator().manual_seed(100 + i)
    b, l = 2, 5
    rows_l = l + 1 if shift else l
    full = torch.randn(b, rows_l, v, generator=g, dtype=torch.float64) * 3.0 + ex.get("offset", 0.0)
    lo, hi = _split(v, ctx.world)[-1]
    if ex.get("mask_last_shard"):  # rows whose last shard is all -inf, and an id pointing into it
        full[:, :2, lo:hi] = float("-inf")
        full[1, 3, :7] = float("-inf")
    full = full.to(dtype)
    ignore_index = ex.get("ignore_index", -100)
    ishape = (b, l) + ((k,) if k else ())
    idx = torch.randint(0, v, ishape, generator=g)
    if ex.get("ignore"):
        idx[0, 1] = -100
    if ex.get("mask_last_shard") and hi > lo:
        idx[0, 0] = lo  # a -inf logit: log-prob -inf
    if ex.get("at_max"):
        idx[:, 0] = full[:, 0].argmax(-1)  # at the row max too, where the log-prob is near 0
    if ex.get("int32"):
        idx = idx.int()
    want_lp, want_ent = fn in ("both", "logp"), fn in ("both", "ent")

    x = distribute_tensor(full, ctx.mesh, [Shard(-1)]).requires_grad_(True)
    index = distribute_tensor(idx, ctx.mesh, [Replicate()]) if ex.get("index_dtensor") else idx
    ref_x = full.clone().requires_grad_(True)

    def call(logits, index):
        if fn == "both":
            return torch_fused.logprobs_and_entropy(logits, index, temperature=t, ignore_index=ignore_index,
                                                    shift=shift)
        if fn == "logp":
            return torch_fused.selective_log_softmax(logits, index, temperature=t, ignore_index=ignore_index,
                                                     shift=shift), None
        return None, torch_fused.entropy_from_logits(logits, temperature=t, shift=shift)

    with CollectiveCounter(host_copies=True) as fwd_calls:
        lp, ent = call(x, index)
    slp, sent = call(ref_x, idx)  # the single-device op, same process
    rlp, rent = ref_logprobs_entropy(full[:, :-1] if shift else full, idx if want_lp else None, t, ignore_index)
    g1 = torch.randn(ishape, generator=g, dtype=torch.float64)
    g2 = torch.randn(b, l, generator=g, dtype=torch.float64)
    outs = [(o, gg) for o, gg in ((lp, g1), (ent, g2)) if o is not None]
    with CollectiveCounter(host_copies=True) as bwd_calls:
        sum((o.to_local().double() * gg).nan_to_num(0.0, 0.0, 0.0).sum() for o, gg in outs).backward()
    sum((o.double() * gg).nan_to_num(0.0, 0.0, 0.0).sum() for o, gg in zip((slp, sent), (g1, g2))
        if o is not None).backward()
    label = f"logits case {i}: {fn} V={v} {dtype} T={t} K={k} shift={shift} {ex}"
    cols = 2 + int(want_ent) + ((k or 1) if want_lp else 0)
    with ctx.soft(label + " placements"):
        for o in (lp, ent):
            if o is not None:
                assert isinstance(o, DTensor) and o.placements == (Replicate(),), (type(o), getattr(o, "placements", 0))
                assert o.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert isinstance(x.grad, DTensor) and x.grad.placements == (Shard(2),), x.grad
        assert x.grad.shape == full.shape and x.grad.dtype == dtype, (x.grad.shape, x.grad.dtype)
    with ctx.soft(label + " collectives"):
        # forward: ONE all-gather of the per-row partials (and no host-to-device copy); backward: nothing
        assert fwd_calls == [("all_gather_into_tensor", b * l * cols)], fwd_calls
        # (the CPU reference backward writes shift's zero row from a Python 0, a host tensor on CPU: no copy)
        assert [c for c in bwd_calls if c[0] != "lift_fresh" or INTERPRET] == [], bwd_calls
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    with ctx.soft(label + " values"):
        for name, o, so, ro in (("logp", lp, slp, rlp), ("entropy", ent, sent, rent)):
            if o is None:
                continue
            out = o.to_local()
            assert_logprob_close(out, ro, v, f"{name} vs float64", acc)
            # and the single-device op: both within the bound of float64, so within twice it
            err = (out.double() - so.double()).abs()
            fin = torch.isfinite(so)
            assert torch.equal(torch.isnan(out), torch.isnan(so)), f"{name}: NaN pattern differs from single-device"
            assert torch.equal(out[~fin & ~torch.isnan(so)], so[~fin & ~torch.isnan(so)]), f"{name}: infinities"
            bound = 2 * FWD_RTOL[acc] * (so.double().abs() + 1 + math.log(v))
            assert bool((err[fin] <= bound[fin]).all()), f"{name} vs single-device: worst {err[fin].max().item():.3g}"
        if ex.get("ignore"):
            assert bool((lp.to_local()[0, 1] == 0).all())
        if ex.get("mask_last_shard") and hi > lo:
            assert bool((lp.to_local()[0, 0] == float("-inf")).all()), lp.to_local()[0, 0]
    with ctx.soft(label + " gradient"):
        a, c = _split(v, ctx.world)[ctx.rank]
        dx = x.grad.to_local()
        assert dx.shape == full[..., a:c].shape, (dx.shape, a, c)
        # float64 reference gradient of the same loss
        xr = full.double().requires_grad_(True)
        rl, re = ref_logprobs_entropy(xr[:, :-1] if shift else xr, idx if want_lp else None, t, ignore_index)
        terms = ([(rl * g1).nan_to_num(0.0, 0.0, 0.0).sum()] if want_lp else []) + \
            ([(re * g2).sum()] if want_ent else [])
        (rdx,) = torch.autograd.grad(sum(terms), xr)
        # the row's upstream gradient (sum |g_logp| + |g_entropy|) / T: the gradient's fp32 floor
        scale = ((g1.abs().reshape(b, l, -1).sum(-1) if want_lp else 0) + (g2.abs() if want_ent else 0)) / t
        if shift:
            scale = torch.cat([scale, torch.zeros(b, 1, dtype=torch.float64)], 1)
        assert_grad_close(dx, rdx[..., a:c], scale[..., None], dtype, "d logits shard vs float64")
        sdx = ref_x.grad[..., a:c]
        tol = 2 * (GRAD_TOL[dtype] * sdx.double().abs() + 2e-6 * scale[..., None])
        err = (dx.double() - sdx.double()).abs()
        fin = torch.isfinite(sdx.double())
        assert bool((err[fin] <= tol.expand_as(err)[fin]).all()), \
            f"d logits shard vs single-device: worst {err[fin].max().item():.3g}"
        if shift:
            assert bool((dx[:, -1] == 0).all()), "shift: the last position's gradient must be exactly 0"


GRAD_TOL = {torch.bfloat16: 2**-7, torch.float32: 4e-6, torch.float64: 1e-10}


@check()
def logits_values_gradients_collectives(ctx):
    for i, case in enumerate(LOGIT_CASES):
        if INTERPRET and i not in INTERPRET_CASES:
            continue
        _logits_case(ctx, i, case)
    ctx.done()


HEAD_CASES = [
    # V, dtype, T, K, shift, bias, softcap, hidden as a Replicate DTensor
    (37, torch.float32, 0.8, None, False, True, None, False),
    (37, torch.bfloat16, 1.0, 2, True, False, 4.0, True),
    (37, torch.bfloat16, 1.0, None, False, False, None, False),  # in-place d logits (Triton path)
    (4, torch.float32, 1.0, 2, True, True, None, False),  # world 3: an empty weight shard
]


@check()
def head_vocab_sharded_weight(ctx):
    import torch_fused
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch_fused.ops import linear_logprobs as LL

    # forward chunks of 8 columns (16 in the interpreter) at N = 10 rows: a rank's shard spans several
    # chunks, ids v_off + v0 of V
    from torch_fused.settings import current, override

    small = override(lm_head_chunk_bytes=dict(current.lm_head_chunk_bytes, cpu=4 * (16 if INTERPRET else 8) * 10),
                     lm_head_min_cols={},
                     lm_head_dlogits_min_cols={})
    with small:
        _head_cases(ctx, torch_fused, DTensor, Replicate, Shard, distribute_tensor, LL)


def _head_cases(ctx, torch_fused, DTensor, Replicate, Shard, distribute_tensor, LL):
    for i, (v, dtype, t, k, shift, has_bias, softcap, h_dtensor) in enumerate(HEAD_CASES):
        if INTERPRET and i not in (1, 2):  # softcap (fp32 d logits) and the in-place bf16 backward
            continue
        label = f"head case {i}: V={v} {dtype} T={t} K={k} shift={shift} bias={has_bias} softcap={softcap}"
        g = torch.Generator().manual_seed(200 + i)
        b, l, hd = 2, 5, 8
        hf = torch.randn(b, l + shift, hd, generator=g).to(dtype)
        wf = (torch.randn(v, hd, generator=g) / hd**0.5 * 3).to(dtype)
        bf = torch.randn(v, generator=g).to(dtype) if has_bias else None
        ishape = (b, l) + ((k,) if k else ())
        idx = torch.randint(0, v, ishape, generator=g)
        idx[1, 2] = -100
        w = distribute_tensor(wf, ctx.mesh, [Shard(0)]).requires_grad_(True)
        bias = distribute_tensor(bf, ctx.mesh, [Shard(0)]).requires_grad_(True) if has_bias else None
        h = (distribute_tensor(hf, ctx.mesh, [Replicate()]) if h_dtensor else hf.clone()).requires_grad_(True)
        kw = dict(temperature=t, shift=shift, softcap=softcap)
        with CollectiveCounter(host_copies=True) as fwd_calls:
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, bias=bias, **kw)
        sh, sw = hf.clone().requires_grad_(True), wf.clone().requires_grad_(True)
        sb = bf.clone().requires_grad_(True) if has_bias else None
        slp, sent = torch_fused.linear_logprobs_and_entropy(sh, sw, idx, bias=sb, **kw)
        g1 = torch.randn(ishape, generator=g, dtype=torch.float64)
        g2 = torch.randn(b, l, generator=g, dtype=torch.float64)
        with CollectiveCounter(host_copies=True) as bwd_calls:
            ((lp.to_local().double() * g1).sum() + (ent.to_local().double() * g2).sum()).backward()
        ((slp.double() * g1).sum() + (sent.double() * g2).sum()).backward()
        with ctx.soft(label + " placements and collectives"):
            assert lp.placements == (Replicate(),) and ent.placements == (Replicate(),)
            assert isinstance(w.grad, DTensor) and w.grad.placements == (Shard(0),) and w.grad.shape == wf.shape
            if has_bias:
                assert bias.grad.placements == (Shard(0),) and bias.grad.shape == bf.shape
            if h_dtensor:
                assert h.grad.placements == (Replicate(),), h.grad.placements
            assert fwd_calls == [("all_gather_into_tensor", b * l * (3 + (k or 1)))], fwd_calls
            assert bwd_calls == [("all_reduce", b * l * hd)], bwd_calls  # the scored rows' d hidden, once
        acc = torch.float32
        hr, wr = hf.double().requires_grad_(True), wf.double().requires_grad_(True)
        br = bf.double().requires_grad_(True) if has_bias else None
        rlp, rent = ref_linear(hr, wr, idx, br, t, softcap=softcap, shift=shift)
        with ctx.soft(label + " values"):
            assert_logprob_close(lp.to_local(), rlp, v, "logp vs float64", acc)
            assert_logprob_close(ent.to_local(), rent, v, "entropy vs float64", acc)
            for name, o, so in (("logp", lp, slp), ("entropy", ent, sent)):
                err = (o.to_local().double() - so.double()).abs().max().item()
                assert err <= 2 * FWD_RTOL[acc] * (so.double().abs().max().item() + 1 + math.log(v)), (name, err)
            assert bool((lp.to_local()[1, 2] == 0).all())
        rins = [hr, wr] + ([br] if has_bias else [])
        rgrads = torch.autograd.grad((rlp * g1).sum() + (rent * g2).sum(), rins)
        a, c = _split(v, ctx.world)[ctx.rank]
        dh = h.grad.to_local() if h_dtensor else h.grad
        got = [dh, w.grad.to_local()] + ([bias.grad.to_local()] if has_bias else [])
        single = [sh.grad, sw.grad[a:c]] + ([sb.grad[a:c]] if has_bias else [])
        want = [rgrads[0], rgrads[1][a:c]] + ([rgrads[2][a:c]] if has_bias else [])
        with ctx.soft(label + " gradients"):
            for name, gr, sg, rg in zip(("d hidden", "d weight shard", "d bias shard"), got, single, want):
                assert gr.dtype == dtype and gr.shape == rg.shape, (name, gr.dtype, gr.shape, rg.shape)
                if rg.numel() == 0:
                    continue
                floor = 1e-6 * (g1.norm() + g2.norm()).item() / t * (wr.norm() + hr.norm() + 1).item()
                err = (gr.double() - rg).norm().item()
                assert err <= HEAD_GRAD_REL[dtype] * rg.norm().item() + floor, (name, "vs float64", err, rg.norm().item())
                err = (gr.double() - sg.double()).norm().item()
                assert err <= 2 * HEAD_GRAD_REL[dtype] * rg.norm().item() + 2 * floor, (name, "vs single-device", err)
            if shift:
                assert bool((dh[:, -1] == 0).all())
    # a frozen head (weight.requires_grad False, as with LoRA): the rank-local backward skips the
    # d weight GEMMs, and d hidden is the trainable head's
    seen = []
    orig = LL.backward_chunks

    def record(*args, **kwargs):
        seen.append((kwargs.get("hidden_grad"), kwargs.get("weight_grad")))
        return orig(*args, **kwargs)

    g = torch.Generator().manual_seed(300)
    hf, wf = torch.randn(2, 6, 8, generator=g), torch.randn(37, 8, generator=g)
    idx = torch.randint(0, 37, (2, 5), generator=g)
    grads = []
    LL.backward_chunks = record
    try:
        for trainable in (False, True):
            h = hf.clone().requires_grad_(True)
            w = distribute_tensor(wf, ctx.mesh, [Shard(0)]).requires_grad_(trainable)
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, shift=True)
            (lp.to_local().sum() + 0.5 * ent.to_local().sum()).backward()
            grads.append(h.grad)
    finally:
        LL.backward_chunks = orig
    with ctx.soft("frozen head"):
        assert seen == [(True, False), (True, True)], seen
        assert torch.equal(grads[0], grads[1])
    ctx.done()


@check(interpret=False)
def masked_helpers_on_replicated_outputs(ctx):
    """The vocab-parallel outputs (Replicate() DTensors) straight into aggregate_loss, masked_mean
    and mask_reduce: Replicate() DTensor results equal to the single-device ones, and the
    logits' gradient through them still Shard(-1) and equal to the single-device gradient."""
    import torch_fused
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(11)
    full = torch.randn(3, 6, 29, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 29, (3, 6), generator=g)
    mask = torch.rand(3, 6, generator=g) > 0.3
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64)
    weights = mask * torch.tensor([0.5, 2.0, 1.0, 0.25, 1.0, 3.0], dtype=torch.float64)  # a float mask weighs
    x = distribute_tensor(full, ctx.mesh, [Shard(-1)]).requires_grad_(True)
    ref_x = full.clone().requires_grad_(True)
    outs = []
    for logits in (x, ref_x):
        lp, ent = torch_fused.logprobs_and_entropy(logits, idx)
        a = distribute_tensor(adv, ctx.mesh, [Replicate()]) if logits is x else adv  # DTensor math wants DTensors
        per_token = -a * lp - 0.01 * ent
        loss = torch_fused.aggregate_loss(per_token, weights, "seq-mean-token-mean")
        mean_ent = torch_fused.masked_mean(ent, weights, 1)
        sums = torch_fused.mask_reduce(per_token, 1, mask)
        loss.backward()
        outs.append((loss, mean_ent, sums, logits.grad))
    for name, got, want in zip(("loss", "masked_mean", "mask_reduce"), outs[0][:3], outs[1][:3]):
        with ctx.soft(name):
            assert isinstance(got, DTensor) and got.placements == (Replicate(),), (type(got), name)
            torch.testing.assert_close(got.to_local(), want.detach(), rtol=1e-10, atol=1e-12)
    with ctx.soft("gradient"):
        gx = outs[0][3]
        assert isinstance(gx, DTensor) and gx.placements[0].is_shard(), gx
        torch.testing.assert_close(gx.full_tensor(), outs[1][3], rtol=1e-10, atol=1e-12)
    with ctx.soft("a sharded input is refused"):
        try:
            torch_fused.masked_mean(distribute_tensor(full[..., 0], ctx.mesh, [Shard(0)]), mask)
        except ValueError as e:
            assert "values: expected a DTensor with Replicate() placements" in str(e), e
        else:
            raise AssertionError("no error for a Shard(0) DTensor")
    ctx.done()


@check(interpret=False)
def mesh_dim_on_a_2d_mesh(ctx):
    """A (1, W) mesh, logits (Replicate(), Shard(-1)): mesh_dim by index or by name; the other
    dims must be Replicate()."""
    import torch_fused
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh2 = init_device_mesh("cpu", (1, ctx.world), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(7)
    full = torch.randn(2, 5, 23, generator=g)
    idx = torch.randint(0, 23, (2, 5), generator=g)
    x = distribute_tensor(full, mesh2, [Replicate(), Shard(2)]).requires_grad_(True)
    slp, sent = torch_fused.logprobs_and_entropy(full, idx)
    for md in (1, "tp", -1):
        with ctx.soft(f"mesh_dim={md!r}"):
            lp, ent = torch_fused.logprobs_and_entropy(x, idx, mesh_dim=md)
            assert lp.placements == (Replicate(), Replicate()) and lp.device_mesh == mesh2
            assert_logprob_close(lp.to_local(), slp, 23, "logp vs single-device (2-D mesh)")
            assert_logprob_close(ent.to_local(), sent, 23, "entropy vs single-device (2-D mesh)")
    with ctx.soft("2-D mesh gradient"):
        lp.to_local().sum().backward()
        assert x.grad.placements == (Replicate(), Shard(2)), x.grad.placements
    ctx.done()


@check(interpret=False)
def gradient_metadata(ctx):
    """The gradients of Shard(-1) logits and of a Shard(0) head weight (and bias) are DTensors
    with the input's placements, global shape and global stride, the same on every rank, when V
    does not divide by the world size. torch's own to_local backward derives the global stride
    from the local shard's ((38, 1) on one rank, (36, 1) on the other for V = 37 over 2);
    torch.autograd.grad returns that as is, and torch 2.11's gradient accumulation turned it into
    a full-size Replicate() gradient."""
    import torch_fused
    from torch.distributed.tensor import Shard, distribute_tensor

    v = 37
    g = torch.Generator().manual_seed(5)
    full = torch.randn(2, 5, v, generator=g)
    idx = torch.randint(0, v, (2, 5), generator=g)
    w_full, b_full = torch.randn(v, 8, generator=g), torch.randn(v, generator=g)
    x = distribute_tensor(full, ctx.mesh, [Shard(-1)]).requires_grad_(True)
    w = distribute_tensor(w_full, ctx.mesh, [Shard(0)]).requires_grad_(True)
    b = distribute_tensor(b_full, ctx.mesh, [Shard(0)]).requires_grad_(True)
    lp, ent = torch_fused.logprobs_and_entropy(x, idx)
    lp2, ent2 = torch_fused.linear_logprobs_and_entropy(torch.randn(2, 5, 8, generator=g), w, idx, bias=b)
    loss = (lp.to_local() + ent.to_local() + lp2.to_local() + ent2.to_local()).sum()
    grads = torch.autograd.grad(loss, (x, w, b))
    for name, t, gt in (("logits", x, grads[0]), ("weight", w, grads[1]), ("bias", b, grads[2])):
        with ctx.soft(f"d {name}"):
            assert gt.placements == t.placements, (gt.placements, t.placements)
            assert gt.shape == t.shape and gt.stride() == t.stride(), (gt.shape, gt.stride(), t.shape, t.stride())
            assert gt.to_local().shape == t.to_local().shape, (gt.to_local().shape, t.to_local().shape)
    ctx.done()


@check(interpret=False)
def unsupported_placements_fail_clearly(ctx):
    import torch_fused
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    w_ = ctx.world
    full = torch.randn(w_, 5, 7)
    idx = torch.randint(0, 7, (w_, 5))
    mesh2 = init_device_mesh("cpu", (1, w_))
    x = distribute_tensor(full, ctx.mesh, [Shard(-1)])
    cases = [
        ("partial", lambda: torch_fused.logprobs_and_entropy(
            DTensor.from_local(full, ctx.mesh, [Partial()], run_check=False), idx),
         r"logits: expected placement Shard\(-1\) on a 1-D mesh, got \(Partial\(sum\),\)"),
        ("shard on another dim", lambda: torch_fused.selective_log_softmax(
            distribute_tensor(full, ctx.mesh, [Shard(0)]), idx),
         r"logits: expected placement Shard\(-1\) on a 1-D mesh, got \(Shard\(dim=0\),\)"),
        ("replicate", lambda: torch_fused.entropy_from_logits(distribute_tensor(full, ctx.mesh, [Replicate()])),
         r"logits: expected placement Shard\(-1\) on a 1-D mesh, got \(Replicate\(\),\)"),
        ("2-D mesh without mesh_dim", lambda: torch_fused.logprobs_and_entropy(
            distribute_tensor(full, mesh2, [Replicate(), Shard(2)]), idx),
         r"logits: expected placement Shard\(-1\) on a 1-D mesh \(or pass mesh_dim.*\(Replicate\(\), "
         r"Shard\(dim=2\)\) on a 2-D mesh"),
        ("2-D mesh, other dim not Replicate", lambda: torch_fused.logprobs_and_entropy(
            distribute_tensor(full, mesh2, [Shard(0), Shard(2)]), idx, mesh_dim=1),
         r"logits: expected Replicate\(\) on every mesh dim but the vocabulary's \(1\), got \(Shard\(dim=0\), "
         r"Shard\(dim=2\)\)"),
        ("2-D mesh, wrong mesh_dim", lambda: torch_fused.logprobs_and_entropy(
            distribute_tensor(full, mesh2, [Replicate(), Shard(2)]), idx, mesh_dim=0),
         r"logits: expected placement Shard\(-1\) on mesh dim 0, got \(Replicate\(\), Shard\(dim=2\)\)"),
        ("index on another mesh", lambda: torch_fused.logprobs_and_entropy(
            x, distribute_tensor(idx, mesh2, [Replicate(), Replicate()])),
         r"index: expected a plain tensor or a DTensor on the mesh of logits"),
        ("sharded index", lambda: torch_fused.logprobs_and_entropy(x, distribute_tensor(idx, ctx.mesh, [Shard(0)])),
         r"index: expected a plain tensor \(the same on every rank\) or a Replicate\(\) DTensor, got placements "
         r"\(Shard\(dim=0\),\)"),
        ("tensor temperature", lambda: torch_fused.logprobs_and_entropy(x, idx, temperature=torch.tensor(0.5)),
         r"temperature: a tensor temperature is not supported with DTensor inputs"),
        ("index shape", lambda: torch_fused.logprobs_and_entropy(x, idx[:, :3]),
         r"index: expected shape \(%d, 5\)" % w_),
        ("weight on dim 1", lambda: torch_fused.linear_logprobs_and_entropy(
            torch.randn(2, 3 * w_), distribute_tensor(torch.randn(7, 3 * w_), ctx.mesh, [Shard(1)]),
            torch.zeros(2, dtype=torch.long)),
         r"weight: expected placement Shard\(0\) on a 1-D mesh, got \(Shard\(dim=1\),\)"),
        ("plain bias", lambda: torch_fused.linear_logprobs_and_entropy(
            torch.randn(2, 4), distribute_tensor(torch.randn(7, 4), ctx.mesh, [Shard(0)]),
            torch.zeros(2, dtype=torch.long), bias=torch.randn(7)),
         r"bias: expected a DTensor placed as the weight, \(Shard\(dim=0\),\) on its mesh, got a plain Tensor"),
        ("sharded hidden", lambda: torch_fused.linear_logprobs_and_entropy(
            distribute_tensor(torch.randn(w_, 4), ctx.mesh, [Shard(0)]),
            distribute_tensor(torch.randn(7, 4), ctx.mesh, [Shard(0)]), torch.zeros(w_, dtype=torch.long)),
         r"hidden: expected a plain tensor \(the same on every rank\) or a Replicate\(\) DTensor, got placements "
         r"\(Shard\(dim=0\),\)"),
        ("mesh_dim with plain tensors", lambda: torch_fused.logprobs_and_entropy(full, idx, mesh_dim=0),
         r"mesh_dim: only for DTensor inputs"),
    ]
    import re

    for name, call, msg in cases:
        with ctx.soft(name):
            try:
                call()
            except (ValueError, RuntimeError) as e:
                assert re.search(msg, str(e)), f"{name}: message {str(e)!r} does not match {msg!r}"
            else:
                raise AssertionError(f"{name}: no error")
    bad = idx.clone()
    bad[1, 2] = 7  # outside [0, V): IndexError on the CPU reference path, as single-device
    with ctx.soft("index out of range"):
        try:
            torch_fused.logprobs_and_entropy(x, bad)
        except IndexError as e:
            assert "index: value 7 is outside [0, V=7)" in str(e), str(e)
        else:
            raise AssertionError("index out of range: no IndexError")
    ctx.done()


def _compile_target(ctx):
    """(device, torch.compile backend) of a compiled check: the gloo ranks' CPU with aot_eager, or
    what the one-rank NCCL test sets on its ctx (CUDA, inductor)."""
    return getattr(ctx, "device", "cpu"), getattr(ctx, "backend", "aot_eager")


def _loss_and_grads(ctx, fn, full, w_full, hid, idx):
    """(value, d logits, d weight, d hidden) of fn(logits, weight, hidden, idx), the logits and
    the weight distributed Shard(-1) / Shard(0) on ctx's mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(full, ctx.mesh, [Shard(-1)]).requires_grad_(True)
    w = distribute_tensor(w_full, ctx.mesh, [Shard(0)]).requires_grad_(True)
    h = hid.clone().requires_grad_(True)
    value = fn(x, w, h, idx)
    value.backward()
    return value, x.grad, w.grad, h.grad


@check(worlds=(2,))
def compiled_fullgraph(ctx):
    """torch.compile(fullgraph=True) traces the DTensor path (Dynamo's autograd.Function support and
    the functional collectives): the same values and gradient placements as eager. At world size 2
    only: tracing takes ~14 s, and the traced code does not depend on the world size. In the
    interpreter run too: there the local backward runs the Triton kernels' host code, as on CUDA,
    which Dynamo must see only as the registered slice-backward ops."""
    import torch_fused
    from torch.distributed.tensor import Shard

    dev, backend = _compile_target(ctx)
    g = torch.Generator().manual_seed(11)
    full = torch.randn(2, 6, 23, generator=g).to(dev)
    idx = torch.randint(0, 23, (2, 5), generator=g).to(dev)
    w_full = torch.randn(23, 8, generator=g).to(dev)
    hid = torch.randn(2, 6, 8, generator=g).to(dev)

    def loss(x, w, h, idx):
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, shift=True, temperature=0.8)
        lp2, ent2 = torch_fused.linear_logprobs_and_entropy(h, w, idx, shift=True)
        return (lp.to_local() * 0.3).sum() + ent.to_local().sum() + lp2.to_local().sum() - ent2.to_local().sum()

    torch._dynamo.reset()
    step = torch.compile(loss, backend=backend, fullgraph=True)
    outs = [_loss_and_grads(ctx, fn, full, w_full, hid, idx) for fn in (loss, step)]
    with ctx.soft("compiled vs eager"):
        (v0, dx0, dw0, dh0), (v1, dx1, dw1, dh1) = outs
        assert dx1.placements == (Shard(2),) and dw1.placements == (Shard(0),), (dx1.placements, dw1.placements)
        torch.testing.assert_close(v1, v0)
        torch.testing.assert_close(dx1.to_local(), dx0.to_local())
        torch.testing.assert_close(dw1.to_local(), dw0.to_local())
        torch.testing.assert_close(dh1, dh0)
    ctx.done()


@check(interpret=False, worlds=(2,))
def compiled_dynamic_shapes(ctx):
    """torch.compile(fullgraph=True, dynamic=True) of the DTensor paths (the README's compile
    form): two sequence lengths through one graph, equal to eager. The global-shape checks run
    in Dynamo's trace there (a torch._check message over tensors could not be traced, and the
    head's float checks used math.isfinite on a symbolic float). Then the compiled head on CPU
    with an id outside the vocabulary (no IndexError: the check would be data-dependent): NaN at
    its position and in its d hidden row, d weight that of the id ignored (it was all NaN)."""
    import torch_fused
    from torch.distributed.tensor import Shard, distribute_tensor

    dev, backend = _compile_target(ctx)
    g = torch.Generator().manual_seed(12)
    w_full = torch.randn(23, 8, generator=g).to(dev)

    # three vocabulary-parallel calls in one graph (a second one failed inside Dynamo with
    # dynamic=True: module-level floats read in the first autograd.Function's trace)
    def loss(x, w, h, idx):
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, shift=True, temperature=0.8)
        ref = torch_fused.selective_log_softmax(x * 0.5, idx, shift=True)
        lp2, ent2 = torch_fused.linear_logprobs_and_entropy(h, w, idx, shift=True)
        return ((lp.to_local() * 0.3).sum() + ent.to_local().sum() + (ref.to_local() * 0.2).sum()
                + lp2.to_local().sum() - ent2.to_local().sum())

    def head(w, h, idx):
        lp2, ent2 = torch_fused.linear_logprobs_and_entropy(h, w, idx, shift=True)
        return lp2.to_local(), ent2.to_local()

    torch._dynamo.reset()
    step = torch.compile(loss, backend=backend, fullgraph=True, dynamic=True)
    for length in (5, 7):
        full = torch.randn(2, length + 1, 23, generator=g).to(dev)
        hid = torch.randn(2, length + 1, 8, generator=g).to(dev)
        idx = torch.randint(0, 23, (2, length), generator=g).to(dev)
        outs = []
        for fn in (loss, step):
            value, dx, dw, dh = _loss_and_grads(ctx, fn, full, w_full, hid, idx)
            # whole gradients: torch 2.11 places the compiled d logits Replicate() here (Shard(-1)
            # eagerly; the static-shape check asserts the placements)
            outs.append((value, dx.full_tensor(), dw.full_tensor(), dh))
        with ctx.soft(f"L={length}: compiled (dynamic) vs eager"):
            for a, b in zip(*outs):
                torch.testing.assert_close(b, a)
    compiled_head = torch.compile(head, backend=backend, fullgraph=True, dynamic=True)
    bad = idx.clone()
    bad[0, 1] = 26
    ignored = idx.clone()
    ignored[0, 1] = -100
    got = []
    for fn, ids in ((compiled_head, bad), (head, ignored)):
        w = distribute_tensor(w_full, ctx.mesh, [Shard(0)]).requires_grad_(True)
        h = hid.clone().requires_grad_(True)
        lp, ent = fn(w, h, ids)
        (lp.nan_to_num(0.0).sum() + ent.sum()).backward()
        got.append((lp, w.grad.full_tensor(), h.grad))
    with ctx.soft("compiled head, id outside the vocabulary"):
        (lp, dw, dh), (lp_ign, dw_ign, dh_ign) = got
        assert bool(lp[0, 1].isnan()) and not bool(lp.isnan().sum() > 1), lp
        torch.testing.assert_close(dw, dw_ign)
        assert bool(dh[0, 1].isnan().all()), dh[0, 1]
        keep = torch.ones(dh.shape[:2], dtype=torch.bool, device=dh.device)
        keep[0, 1] = False
        torch.testing.assert_close(dh[keep], dh_ign[keep])
    ctx.done()


# ---------------------------------------------------------------------------------------------
# The group
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def group(request, tmp_path_factory):
    world = request.param
    return world, CHECKS.run_group(world, tmp_path_factory.mktemp(f"vocab_parallel_w{world}"))


_assert_check = CHECKS.assert_check


def test_logits_values_gradients_and_collectives(group):
    """selective_log_softmax / entropy_from_logits / logprobs_and_entropy on Shard(-1) logits:
    values and Shard(-1) gradients equal to the single-device op's (and float64's), one
    all-gather of O(rows) elements forward, no collective backward."""
    _assert_check(group, "logits_values_gradients_collectives")


def test_masked_helpers_on_replicated_outputs(group):
    """aggregate_loss / masked_mean / mask_reduce on the vocab-parallel functions' Replicate()
    DTensor outputs: Replicate() results, Shard(-1) logits gradient, both equal to one device's."""
    _assert_check(group, "masked_helpers_on_replicated_outputs")


def test_head_with_vocab_sharded_weight(group):
    """linear_logprobs_and_entropy with a Shard(0) weight (and bias): values, d hidden (one
    all-reduce of N * H), d weight and d bias still Shard(0)."""
    _assert_check(group, "head_vocab_sharded_weight")


def test_mesh_dim_on_a_2d_mesh(group):
    _assert_check(group, "mesh_dim_on_a_2d_mesh")


def test_gradient_metadata(group):
    _assert_check(group, "gradient_metadata")


def test_unsupported_placements_fail_clearly(group):
    _assert_check(group, "unsupported_placements_fail_clearly")


def test_compiled_fullgraph(group):
    _assert_check(group, "compiled_fullgraph")


def test_compiled_dynamic_shapes(group):
    _assert_check(group, "compiled_dynamic_shapes")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["compiled_fullgraph", "compiled_dynamic_shapes"])
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_checks_on_one_nccl_rank(name, backend, tmp_path):
    """The compiled checks on CUDA: a one-rank NCCL process group in this process runs the same
    checks as the gloo ranks (static and dynamic shapes, several vocabulary-parallel calls in one
    graph), compiled equal to eager. The local backward of a vocabulary slice is one registered
    op each for the logits and the head (Dynamo stopped in the Triton launch code before)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from _distributed import Ctx

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ctx = Ctx(0, 1, init_device_mesh("cuda", (1,)))
        ctx.device, ctx.backend = "cuda", backend
        CHECKS.checks[name][0](ctx)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_rank_local_pieces_large_logits(device, offset):
    """The pieces every rank runs, without a process group: each slice's partials, the merge of
    all of them (what every rank does with the all-gather's output) and each slice's local
    backward. Logits near +-1e4 with an O(1) spread: the shards' shifts must be differenced as
    the kernels form them, rounded products of m c on the GPU (an exact difference there would
    be off by up to an ulp of 1.4e4, 1e-3): log-probs and entropy within 1e-4 nats of float64, as
    the single-device test_large_logits_absolute_error. On CUDA this is the only test of that path."""
    from torch_fused import parallel as P
    from torch_fused._library import LOG2E

    gen = torch.Generator().manual_seed(9)
    v, world = (40, 3) if INTERPRET else (5000, 3)
    starts, sizes = P.chunk_split(v, world)
    for t in (1.0, 0.7):
        x64 = offset + 3 * torch.randn(2, 3, v, generator=gen, dtype=torch.float64)
        x = x64.float().to(device)
        idx = torch.randint(0, v, (2, 3, 2), generator=gen)
        idx[..., 0] = x64.argmax(-1)  # at the row max too, where the log-prob is near 0
        idx = idx.to(device)
        parts = torch.stack([P.logits_partials(x[..., s:s + n], idx, s, t, True, False)
                             for s, n in zip(starts, sizes)])
        lp, ent, stats = P.merge_partials(parts, idx.reshape(6, 2), -100, sizes[0], v, LOG2E / t,
                                          P._exact_shift(x, torch.float32, LOG2E / t), True)
        xr = x.cpu().double().requires_grad_(True)
        rlp, rent = ref_logprobs_entropy(xr, idx.cpu(), t)
        assert (lp.reshape(2, 3, 2).double().cpu() - rlp).abs().max().item() <= 1e-4, "logp"
        assert (ent.reshape(2, 3).double().cpu() - rent).abs().max().item() <= 1e-4, "entropy"
        g1 = torch.randn(2, 3, 2, generator=gen, dtype=torch.float64)
        g2 = torch.randn(2, 3, generator=gen, dtype=torch.float64)
        dx = torch.cat([P.logits_backward(g1.float().to(device), g2.float().to(device), x[..., s:s + n], idx,
                                          stats.reshape(2, 3, 2), ent.reshape(2, 3), t, -100, False, s, v)
                        for s, n in zip(starts, sizes)], -1)
        (rdx,) = torch.autograd.grad((rlp * g1).sum() + (rent * g2).sum(), xr)
        assert_grad_close(dx, rdx, (g1.abs().sum(-1) + g2.abs())[..., None] / t, torch.float32, f"d logits T={t}")


def test_chunk_split_matches_dtensor():
    """parallel.chunk_split (offsets from the global shape, no collective) is DTensor's split."""
    from torch_fused.parallel import chunk_split

    for v in (1, 2, 4, 5, 7, 37, 151936):
        for world in (1, 2, 3, 4, 8):
            starts, sizes = chunk_split(v, world)
            chunks = torch.arange(v).chunk(world)
            want = [(int(c[0]), len(c)) for c in chunks] + [(v, 0)] * (world - len(chunks))
            assert list(zip(starts, sizes)) == want, (v, world)


def test_every_check_has_a_test():
    import sys

    from _distributed import assert_every_check_has_a_test

    assert_every_check_has_a_test(CHECKS, sys.modules[__name__])
