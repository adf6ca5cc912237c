"""fused::distill and fused::linear_distill: the per-token divergence (and the student's entropy)
against float64 formulas written here and against TRL's own code, gradients against float64
autograd, the reduced modes, the top-k teacher with both tails, opcheck, torch.compile, input
errors and out-of-range ids.

Runs on the CPU reference path, on CUDA, and (a few tiny cases: test_logits_kernels, test_head_kernels and two top-k cases) under
TRITON_INTERPRET=1 through the real kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

import torch_fused
from torch.utils._python_dispatch import TorchDispatchMode

from torch_fused._library import INTERPRET
from torch_fused.meta.distill import DistillOptions
from torch_fused.ops.distill import chunk_plan, vocab_plan
from torch_fused.settings import DEFAULTS, override
from _helpers import DEVICES

plain_cpu_only = pytest.mark.skipif(INTERPRET, reason="the plain CPU run covers it (the interpreter run keeps the "
                                                      "kernel cases marked for it)")

BETAS = [0.0, 0.5, 1.0, 0.3]
# per-token divergence and entropy (assert_div_close): fp32 outputs, float64 for float64 inputs
FWD_32, FWD_64 = 2e-6, 1e-12
# norm-wise relative error of the gradients: one rounding to the dtype (bf16 2^-8; the
# interpreter truncates, up to 2^-7), fp32 arithmetic otherwise
GRAD_REL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 4e-6, torch.float64: 1e-10}


@pytest.fixture(autouse=True)
def small_chunks():
    """Head chunks of a few rows and d logits groups of a few chunks, so small shapes take several
    ragged chunks and groups (the fp32 d weight accumulator over groups): at V = 40, chunks of 4
    rows; groups of 8 rows in bf16 (the kernel path's d logits), one chunk in fp32; the kernels'
    rows in segments of 32 columns where the rows are few (the head's chunks)."""
    with override(distill_chunk_bytes={"cpu": 8 * 40 * 4, "cuda": 8 * 40 * 4},
                  distill_group_bytes={"cpu": 2 * 40 * 8, "cuda": 2 * 40 * 8}, distill_min_rows={},
                  distill_max_extra={}, distill_segment=32):
        yield


# ---------------------------------------------------------------------------------------------
# float64 formulas (independent of torch_fused.reference)
# ---------------------------------------------------------------------------------------------
def ref_transform(y, scale=1.0, softcap=None, t=1.0):
    y = y.double() * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    return y / t


def ref_divergence(zs, zt, beta, dtype=torch.float64):
    """Per row of z (the logits divided by T), in float64 (or ``dtype``: the materialized formula
    as TRL evaluates it): TRL's definitions."""
    ls, lt = torch.log_softmax(zs.to(dtype), -1), torch.log_softmax(zt.to(dtype), -1)
    ps, pt = ls.exp(), lt.exp()

    def kl(p, lp, lq):
        return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(-1)

    if beta == 0.0:
        return kl(pt, lt, ls)
    if beta == 1.0:
        return kl(ps, ls, lt)
    lm = torch.log((1 - beta) * ps + beta * pt)
    return beta * kl(pt, lt, lm) + (1 - beta) * kl(ps, ls, lm)


def ref_entropy(zs):
    ls = torch.log_softmax(zs.double(), -1)
    return -torch.where(ls.exp() > 0, ls.exp() * ls, torch.zeros_like(ls)).sum(-1)


def ref_topk(zs, ids, lp_t, beta, tail, valid):
    """The top-k teacher in probability space: the student's full softmax at the k ids, a tail
    1 - sum p on each side (clamped as TRL clamps it) or both renormalized, then the divergence
    over the categories. float64."""
    ls = torch.log_softmax(zs.double(), -1)
    ps = torch.where(valid, ls.gather(-1, ids.clamp(0, zs.shape[-1] - 1)).exp(), torch.zeros_like(lp_t.double()))
    pt = torch.where(valid, lp_t.double().exp(), torch.zeros_like(ps))
    if tail == "bucket":
        cap = math.exp(-1e-7)  # TRL: log(sum) <= -1e-7
        ps = torch.cat([ps, (1 - ps.sum(-1, keepdim=True).clamp(max=cap))], -1)
        pt = torch.cat([pt, (1 - pt.sum(-1, keepdim=True).clamp(max=cap))], -1)
    else:
        ps = ps / ps.sum(-1, keepdim=True).clamp_min(1e-300)  # (a position without a used slot: 0)
        pt = pt / pt.sum(-1, keepdim=True).clamp_min(1e-300)

    def kl(p, q):
        live = p > 0  # (the logs of the other categories' stand-in 1: no 0 * inf in the gradient)
        one = torch.ones_like(p)
        return torch.where(live, p * (torch.where(live, p, one).log() - torch.where(live, q, one).log()),
                           torch.zeros_like(p)).sum(-1)

    if beta == 0.0:
        return kl(pt, ps)
    if beta == 1.0:
        return kl(ps, pt)
    m = (1 - beta) * ps + beta * pt
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def assert_div_close(out, ref, v, what):
    """|out - ref| <= FWD * (|ref| + 1 + ln V): fp32 arithmetic on log-probs of size up to ~ln V."""
    unit = FWD_64 if out.dtype == torch.float64 else FWD_32
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    torch.testing.assert_close(torch.isnan(out), torch.isnan(ref), msg=f"{what}: NaN pattern differs")
    fin = ~torch.isnan(ref)
    bound = unit * (ref[fin].abs() + 1 + math.log(v))
    err = (out[fin] - ref[fin]).abs()
    assert bool((err <= bound).all()), f"{what}: worst error {err.max().item():.3g} (bound {bound.min().item():.3g}+)"


def _grad_rel(g, rg):
    g, rg = g.double().cpu(), rg.double().cpu()
    return ((g - rg).norm() / rg.norm().clamp_min(1e-6 * math.sqrt(rg.numel()))).item()


def assert_grad_rel(g, rg, dtype, what, floor=0.0):
    """Norm-wise relative error within GRAD_REL[dtype], or within ``floor`` where that is larger;
    a gradient that is exactly 0 (V = 1) against rounding noise far below any gradient's scale
    (1e-6 of a unit per element) passes."""
    rel, bound = _grad_rel(g, rg), max(GRAD_REL[dtype], floor)
    assert rel <= bound, f"{what}: relative error {rel:.3g} > {bound:.3g}"


def _labels(gen, shape, device, frac=0.3):
    lab = torch.randint(0, 50, shape, generator=gen)
    lab[torch.rand(shape, generator=gen) < frac] = -100
    return lab.to(device)


# ---------------------------------------------------------------------------------------------
# From logits
# ---------------------------------------------------------------------------------------------
def _check_logits(device, dtype, beta, t, shift, with_labels, v=37, b=2, l=5, seed=0, teacher_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    lead = (b, l + 1) if shift else (b, l)
    s = (torch.randn(*lead, v, generator=gen) * 3).to(device, dtype).requires_grad_(True)
    tt = (torch.randn(*lead, v, generator=gen) * 3).to(device, teacher_dtype or dtype)
    lab = _labels(gen, (b, l), device) if with_labels else None
    g = torch.randn(b, l, generator=gen).to(device)
    div, ent = torch_fused.distill(s, tt, beta=beta, temperature=t, labels=lab, shift=shift, return_entropy=True)
    (ds,) = torch.autograd.grad((div * g).sum(), s)
    sd = s.detach().double().requires_grad_(True)
    rows = (lambda x: x[:, :-1]) if shift else (lambda x: x)
    rdiv = ref_divergence(rows(sd) / t, rows(tt.double()) / t, beta)
    if lab is not None:
        rdiv = torch.where(lab.cpu() != -100, rdiv.cpu(), torch.zeros_like(rdiv.cpu())).to(rdiv.device)
    (rds,) = torch.autograd.grad((rdiv * g.double()).sum(), sd)
    what = f"{dtype} beta={beta} T={t} shift={shift} labels={with_labels}"
    assert div.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_div_close(div, rdiv, v, f"divergence {what}")
    assert_div_close(ent, ref_entropy(rows(sd.detach()) / t), v, f"entropy {what}")
    assert ds.dtype == dtype and ds.shape == s.shape
    floor = 0.0
    if dtype == torch.float32:
        # fp32 logits: the JSD gradient p_s (ln(p_s / m) - KL(s || m)) cancels where the supports
        # barely overlap, so the rounding of fp32 log-probs sets its accuracy: no worse than the
        # materialized formula evaluated in fp32 (as TRL runs it) on the same inputs
        s32 = s.detach().requires_grad_(True)
        r32 = ref_divergence(rows(s32) / t, rows(tt.float()) / t, beta, torch.float32)
        if lab is not None:
            r32 = torch.where(lab != -100, r32, torch.zeros_like(r32))
        (ds32,) = torch.autograd.grad((r32 * g).sum(), s32)
        floor = _grad_rel(ds32, rds)
    assert_grad_rel(ds, rds, dtype, f"d student_logits {what}", floor)
    if shift:
        assert bool((ds[:, -1] == 0).all())
    if lab is not None:
        assert bool((ds[:, :l][lab == -100] == 0).all()), "ignored positions got a gradient"


@plain_cpu_only
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_logits_match_float64(device, beta, dtype):
    for t, shift, lab in ((1.0, False, False), (0.7, True, True), (1.6, False, True)):
        _check_logits(device, dtype, beta, t, shift, lab, v=37 if device == "cpu" else 3001)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
def test_logits_kernels(beta):
    """The tiny case of the interpreter run (also plain CPU): each mode's three passes, a
    strided (shifted) bf16 student, an fp32 teacher, labels; a full block and a masked tail."""
    _check_logits("cpu", torch.bfloat16, beta, 0.8, True, True, v=20, l=2, teacher_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# From hidden states and heads
# ---------------------------------------------------------------------------------------------
def ref_head(sh, sw, th, tw, beta, t, shift, sb=None, tb=None, ss=1.0, ts=1.0, sc=None, tc=None):
    """(per-token divergence, student entropy) of the materialized float64 heads."""
    if shift:
        sh, th = sh[..., :-1, :], th[..., :-1, :]
    ys = sh.double() @ sw.double().t() + (0 if sb is None else sb.double())
    yt = th.double() @ tw.double().t() + (0 if tb is None else tb.double())
    zs, zt = ref_transform(ys, ss, sc, t), ref_transform(yt, ts, tc, t)
    return ref_divergence(zs, zt, beta), ref_entropy(zs)


def _check_head(device, dtype, beta, reduction, *, t=0.9, shift=True, bias=True, ss=1.0, ts=0.6, sc=None, tc=None,
                with_labels=True, v=64, hs=16, ht=24, b=2, l=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lead = (b, l + 1) if shift else (b, l)
    sh = torch.randn(*lead, hs, generator=gen).to(device, dtype).requires_grad_(True)
    sw = (torch.randn(v, hs, generator=gen) / 2).to(device, dtype).requires_grad_(True)
    sb = torch.randn(v, generator=gen).to(device, dtype).requires_grad_(True) if bias else None
    th = torch.randn(*lead, ht, generator=gen).to(device, dtype)
    tw = (torch.randn(v, ht, generator=gen) / 2).to(device, dtype)
    tb = torch.randn(v, generator=gen).to(device, dtype) if bias else None
    lab = _labels(gen, (b, l), device) if with_labels else None
    kw = dict(beta=beta, temperature=t, labels=lab, shift=shift, student_bias=sb, teacher_bias=tb,
              student_logit_scale=ss, teacher_logit_scale=ts, student_softcap=sc, teacher_softcap=tc)
    g = torch.randn(b, l, generator=gen).to(device)
    out, ent = torch_fused.linear_distill(sh, sw, th, tw, reduction=reduction, return_entropy=True, **kw)
    leaves = [sh, sw] + ([sb] if bias else [])
    loss = (out * g).sum() if reduction == "none" else out * 1.7
    grads = torch.autograd.grad(loss, leaves)
    dl = [x.detach().double().requires_grad_(True) for x in leaves]
    rdiv, rent = ref_head(dl[0], dl[1], th, tw, beta, t, shift, dl[2] if bias else None, tb, ss, ts, sc, tc)
    keep = torch.ones(b, l, dtype=torch.bool) if lab is None else (lab.cpu() != -100)
    rdiv = torch.where(keep.to(rdiv.device), rdiv, torch.zeros_like(rdiv))
    if reduction == "none":
        rout, rloss = rdiv, (rdiv * g.double()).sum()
    else:
        rout = rdiv.sum() / (keep.sum().clamp_min(1) if reduction == "token-mean" else 1)
        rloss = rout * 1.7
    rgrads = torch.autograd.grad(rloss, dl)
    what = f"{dtype} beta={beta} {reduction} T={t} shift={shift} bias={bias} softcap={sc, tc}"
    assert out.shape == rout.shape and out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_div_close(out, rout, v, f"divergence {what}")
    assert_div_close(ent, rent, v, f"entropy {what}")
    for name, gg, rg, leaf in zip(("hidden", "weight", "bias"), grads, rgrads, leaves):
        assert gg.dtype == leaf.dtype and gg.shape == leaf.shape
        assert_grad_rel(gg, rg, dtype, f"d student_{name} {what}")
    if shift:
        assert bool((grads[0][:, -1] == 0).all())
    if lab is not None:
        assert bool((grads[0][:, :l][lab == -100] == 0).all()), "ignored positions got a d hidden"


# every beta with every reduction in float32; bf16 (the d logits rounded once) and float64 (the
# reference kept in float64) on a covering subset
HEAD_CASES = ([(torch.float32, beta, red) for beta in BETAS for red in ("none", "token-mean", "sum")]
              + [(torch.bfloat16, 0.0, "none"), (torch.bfloat16, 0.3, "token-mean"), (torch.bfloat16, 1.0, "sum"),
                 (torch.bfloat16, 0.5, "none"), (torch.float64, 0.5, "none"), (torch.float64, 1.0, "token-mean")])


@plain_cpu_only
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,beta,reduction", HEAD_CASES, ids=[f"{str(d)[6:]}-{b}-{r}" for d, b, r in HEAD_CASES])
def test_head_matches_float64(device, beta, reduction, dtype):
    """Per token, the first case's backward runs over vocabulary chunks (vocab_plan: the row
    groups would keep an fp32 d weight accumulator), the second's over row chunks and groups."""
    _check_head(device, dtype, beta, reduction)
    with override(distill_vocab_min_cols={"cpu": 1 << 30, "cuda": 1 << 30}):
        _check_head(device, dtype, beta, reduction, shift=False, bias=False, with_labels=False, ss=1.3, sc=4.0,
                    tc=6.0, t=1.2, seed=1)


@pytest.mark.parametrize("beta,reduction,sc,vocab", [(0.0, "token-mean", None, True), (1.0, "none", 3.0, True),
                                                     (0.3, "sum", None, True), (0.5, "none", None, False)])
def test_head_kernels(beta, reduction, sc, vocab):
    """The interpreter run's tiny head cases (also plain CPU): each mode, both reductions (mode 0's
    one-pass divergence and gradient), three chunks in two groups, a softcap; per token, the
    backward over vocabulary chunks (vocab) and over row chunks and groups."""
    with override(**({} if vocab else dict(distill_vocab_min_cols={"cpu": 1 << 30, "cuda": 1 << 30}))):
        _check_head("cpu", torch.bfloat16, beta, reduction, sc=sc, v=40, hs=8, ht=12, l=5)


@plain_cpu_only
@pytest.mark.parametrize("device", DEVICES)
def test_teacher_of_another_dtype_and_width(device):
    """A float32 teacher of another hidden size beside a bfloat16 student."""
    gen = torch.Generator().manual_seed(3)
    sh = torch.randn(7, 16, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
    sw = (torch.randn(50, 16, generator=gen) / 2).to(device, torch.bfloat16).requires_grad_(True)
    th, tw = torch.randn(7, 40, generator=gen).to(device), (torch.randn(50, 40, generator=gen) / 4).to(device)
    for beta in BETAS:
        div = torch_fused.linear_distill(sh, sw, th, tw, beta=beta)
        dh, dw = torch.autograd.grad(div.sum(), (sh, sw))
        hd, wd = sh.detach().double().requires_grad_(True), sw.detach().double().requires_grad_(True)
        rdiv, _ = ref_head(hd, wd, th, tw, beta, 1.0, False)
        rdh, rdw = torch.autograd.grad(rdiv.sum(), (hd, wd))
        assert_div_close(div, rdiv, 50, f"beta={beta}")
        assert_grad_rel(dh, rdh, torch.bfloat16, "d hidden")
        assert_grad_rel(dw, rdw, torch.bfloat16, "d weight")


# ---------------------------------------------------------------------------------------------
# TRL's own code
# ---------------------------------------------------------------------------------------------
def _trl(module):
    pytest.importorskip("trl")
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(module)
        except ImportError as e:  # pragma: no cover - another TRL layout
            pytest.skip(f"{module}: {e}")


@plain_cpu_only
@pytest.mark.parametrize("beta", BETAS)
def test_equals_trl_generalized_jsd_and_chunked_divergence(beta):
    """Per token, before any reduction: TRL's GKD generalized_jsd_loss (reduction "none", summed
    over the vocabulary) from logits, and TRL's ChunkedDivergenceFunction (divergence and entropy)
    from hidden states and heads, with logit scales and a softcap; to fp32 rounding."""
    gkd = _trl("trl.experimental.gkd.gkd_trainer")
    chunked = _trl("trl.kernels.chunked_divergence")
    gen = torch.Generator().manual_seed(11)
    s, t = torch.randn(2, 6, 45, generator=gen) * 2, torch.randn(2, 6, 45, generator=gen) * 2
    ref = gkd.GKDTrainer.generalized_jsd_loss(s.double(), t.double(), beta=beta, temperature=0.7, reduction="none")
    ref = ref.sum(-1)
    ours = torch_fused.distill(s, t, beta=beta, temperature=0.7)
    assert_div_close(ours, ref, 45, f"generalized_jsd_loss beta={beta}")
    trl32 = gkd.GKDTrainer.generalized_jsd_loss(s, t, beta=beta, temperature=0.7, reduction="none").sum(-1)
    assert_div_close(ours, trl32, 45, f"generalized_jsd_loss fp32 beta={beta}")
    sh, sw = torch.randn(12, 16, generator=gen), torch.randn(45, 16, generator=gen) / 2
    th, tw = torch.randn(12, 24, generator=gen), torch.randn(45, 24, generator=gen) / 2
    sb, tb = torch.randn(45, generator=gen), torch.randn(45, generator=gen)
    rdiv, rent = chunked.ChunkedDivergenceFunction.apply(sh, sw, sb, th, tw, tb, beta, 0.8, 1.5, 5.0, 0.7, None)
    div, ent = torch_fused.linear_distill(sh, sw, th, tw, beta=beta, temperature=0.8, student_bias=sb, teacher_bias=tb,
                                          student_logit_scale=1.5, student_softcap=5.0, teacher_logit_scale=0.7,
                                          return_entropy=True)
    assert_div_close(div, rdiv, 45, f"ChunkedDivergenceFunction beta={beta}")
    assert_div_close(ent, rent, 45, f"ChunkedDivergenceFunction entropy beta={beta}")
    # and the gradients TRL's backward gives (fp32 both)
    leaves = [x.clone().requires_grad_(True) for x in (sh, sw, sb)]
    rdiv, _ = chunked.ChunkedDivergenceFunction.apply(leaves[0], leaves[1], leaves[2], th, tw, tb, beta, 0.8, 1.5,
                                                      5.0, 0.7, None)
    rg = torch.autograd.grad(rdiv.sum(), leaves)
    ours = [x.clone().requires_grad_(True) for x in (sh, sw, sb)]
    div = torch_fused.linear_distill(ours[0], ours[1], th, tw, beta=beta, temperature=0.8, student_bias=ours[2],
                                     teacher_bias=tb, student_logit_scale=1.5, student_softcap=5.0,
                                     teacher_logit_scale=0.7)
    og = torch.autograd.grad(div.sum(), ours)
    for a, b in zip(og, rg):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Top-k teacher
# ---------------------------------------------------------------------------------------------
def _topk_inputs(gen, lead_scored, v, k, device, unused=True):
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(math.prod(lead_scored))])
    ids = ids.reshape(*lead_scored, k)
    lp_t = torch.log_softmax(torch.randn(*lead_scored, v, generator=gen) * 2, -1).gather(-1, ids).float()
    if unused and k > 1:
        ids[0, 0, -1] = -100  # an unused slot (its id is ignore_index)
        lp_t[0, 1, 0] = float("-inf")  # an unused slot (teacher log-prob -inf)
    return ids.to(device), lp_t.to(device)


def _topk_ref(zs, ids, lp_t, beta, tail, lab):
    valid = (ids != -100) & (lp_t != float("-inf"))
    r = ref_topk(zs, ids, lp_t, beta, tail, valid.cpu() if zs.device.type == "cpu" else valid)
    if lab is not None:
        r = torch.where(lab != -100, r, torch.zeros_like(r))
    return r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize("beta", BETAS)
def test_topk_teacher_logits_and_head(device, tail, beta):
    if INTERPRET:
        pytest.skip("the plain CPU run (the student's side runs the log-prob kernels, which their own tests "
                    "take through the interpreter)")
    gen = torch.Generator().manual_seed(5)
    v, k, b, l = 41, 4, 2, 5
    ids, lp_t = _topk_inputs(gen, (b, l), v, k, device)
    lab = _labels(gen, (b, l), device)
    g = torch.randn(b, l, generator=gen).to(device)
    # from logits (shift)
    s = (torch.randn(b, l + 1, v, generator=gen) * 2).to(device).requires_grad_(True)
    div, ent = torch_fused.distill(s, teacher_topk_ids=ids, teacher_topk_logprobs=lp_t, beta=beta, temperature=0.8,
                                   labels=lab, shift=True, tail=tail, return_entropy=True)
    (ds,) = torch.autograd.grad((div * g).sum(), s)
    sd = s.detach().double().requires_grad_(True)
    rdiv = _topk_ref(sd[:, :-1] / 0.8, ids, lp_t, beta, tail, lab)
    (rds,) = torch.autograd.grad((rdiv * g.double()).sum(), sd)
    assert_div_close(div, rdiv, v, f"top-k logits beta={beta} {tail}")
    assert_div_close(ent, ref_entropy(sd[:, :-1].detach() / 0.8), v, "top-k entropy")
    assert_grad_rel(ds, rds, torch.float32, f"top-k d logits beta={beta} {tail}")
    # from the student's head (no shift, bias, softcap)
    hs = torch.randn(b, l, 12, generator=gen).to(device).requires_grad_(True)
    ws = (torch.randn(v, 12, generator=gen) / 2).to(device).requires_grad_(True)
    bs = torch.randn(v, generator=gen).to(device)
    out = torch_fused.linear_distill(hs, ws, teacher_topk_ids=ids, teacher_topk_logprobs=lp_t, beta=beta,
                                     temperature=1.1, labels=lab, tail=tail, student_bias=bs, student_softcap=5.0,
                                     reduction="token-mean")
    dh, dw = torch.autograd.grad(out, (hs, ws))
    hd, wd = hs.detach().double().requires_grad_(True), ws.detach().double().requires_grad_(True)
    zs = ref_transform(hd @ wd.t() + bs.double(), 1.0, 5.0, 1.1)
    rd = _topk_ref(zs, ids, lp_t, beta, tail, lab)
    rout = rd.sum() / (lab != -100).sum()
    rdh, rdw = torch.autograd.grad(rout, (hd, wd))
    assert_div_close(out, rout, v, f"top-k head beta={beta} {tail}")
    assert_grad_rel(dh, rdh, torch.float32, "top-k d hidden")
    assert_grad_rel(dw, rdw, torch.float32, "top-k d weight")


@plain_cpu_only
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_topk_equals_trl_server_distillation(beta, tail):
    """TRL's server-distillation formula per token: the student's log_softmax gathered at the
    teacher's top-k ids, _add_tail_bucket on both sides (or renormalized), then its masked
    _jsd_divergence summed over the categories; including k = 1 and a top-k mass near 1 (the
    tail's clamp)."""
    sd = _trl("trl.experimental.server_distillation.server_distillation_trainer")
    gen = torch.Generator().manual_seed(9)
    for k, v in ((1, 30), (5, 30), (30, 30)):  # k = V: the top-k mass is 1, the tail clamped
        s = torch.randn(3, 4, v, generator=gen) * 2
        ids, lp_t = _topk_inputs(gen, (3, 4), v, k, "cpu", unused=False)
        lp_s = torch.log_softmax(s / 0.9, -1).gather(-1, ids)
        valid = torch.ones_like(ids, dtype=torch.bool)
        if tail == "bucket":
            a, mask = sd._add_tail_bucket(lp_s, valid)
            b, _ = sd._add_tail_bucket(lp_t, valid)
        else:
            a, b, mask = lp_s - lp_s.logsumexp(-1, keepdim=True), lp_t - lp_t.logsumexp(-1, keepdim=True), valid
        ref = sd._jsd_divergence(a, b, beta, mask).sum(-1)
        ours = torch_fused.distill(s, teacher_topk_ids=ids, teacher_topk_logprobs=lp_t, beta=beta, temperature=0.9,
                                   tail=tail)
        assert_div_close(ours, ref, v, f"k={k} beta={beta} {tail}")


@plain_cpu_only
def test_topk_head_runs_the_student_head_only():
    """A top-k teacher's head call makes one fp32 student logits GEMM per vocabulary chunk
    forward (the log-prob head's); no teacher tensors are needed."""
    gen = torch.Generator().manual_seed(2)
    hs, ws = torch.randn(4, 8, generator=gen), torch.randn(20, 8, generator=gen)
    ids, lp_t = _topk_inputs(gen, (1, 4), 20, 3, "cpu", unused=False)
    out = torch_fused.linear_distill(hs, ws, teacher_topk_ids=ids[0], teacher_topk_logprobs=lp_t[0])
    assert out.shape == (4,) and bool(torch.isfinite(out).all())


# ---------------------------------------------------------------------------------------------
# The reduced mode, ignored positions, chunking
# ---------------------------------------------------------------------------------------------
class _CountGemms(TorchDispatchMode):
    """Matrix products dispatched, and calls of the head's backward op (whose GEMMs run inside
    its implementation, below this mode)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                                   torch.ops.fused._linear_distill_backward):
            self.n += 1
        return func(*args, **(kwargs or {}))


@plain_cpu_only
def test_reduced_mode_backward_recomputes_no_gemm():
    """reduction "token-mean": the forward makes the gradients, the backward only scales them
    (no matrix product); "none": the backward recomputes both projections."""
    gen = torch.Generator().manual_seed(4)
    sh = torch.randn(2, 6, 8, generator=gen, requires_grad=True)
    sw = torch.randn(30, 8, generator=gen, requires_grad=True)
    th, tw = torch.randn(2, 6, 8, generator=gen), torch.randn(30, 8, generator=gen)
    counts = {}
    for red in ("token-mean", "none"):
        out = torch_fused.linear_distill(sh, sw, th, tw, reduction=red)
        loss = out if red != "none" else out.mean()
        with _CountGemms() as mode:
            torch.autograd.grad(loss, (sh, sw))
        counts[red] = mode.n
    assert counts["token-mean"] == 0, counts
    assert counts["none"] > 0, counts


@plain_cpu_only
def test_reduced_mode_skips_frozen_gradients():
    """A frozen student head (weight without requires_grad) in the reduced mode: no d weight is
    made (the flag follows requires_grad), d hidden is right; under no_grad none is made."""
    gen = torch.Generator().manual_seed(6)
    sh = torch.randn(5, 8, generator=gen, requires_grad=True)
    sw, th, tw = torch.randn(30, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(30, 8, generator=gen)
    opts = DistillOptions(reduction="sum").values()
    _, _, _, dh, dw, db = torch.ops.fused._linear_distill_forward(sh, sw, None, th, tw, None, None, *opts,
                                                                  hidden_grad=True)
    assert dh.shape == sh.shape and dw.numel() == 0 and db.numel() == 0
    loss = torch_fused.linear_distill(sh, sw, th, tw, reduction="sum")
    (g,) = torch.autograd.grad(loss, sh)
    ref = torch_fused.linear_distill(sh, sw, th, tw).sum()
    (rg,) = torch.autograd.grad(ref, sh)
    torch.testing.assert_close(g, rg)
    with torch.no_grad():
        loss2 = torch_fused.linear_distill(sh, sw, th, tw, reduction="sum")
    torch.testing.assert_close(loss2, loss.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_one_chunk_equals_many(device):
    """The chunk and group sizes change no row's result beyond fp32 summation order (the logits
    GEMM of a chunk of other rows may block its sums otherwise; d weight adds the groups)."""
    if INTERPRET:
        pytest.skip("the plain CPU run covers the chunk loop; the interpreter run's head cases take several chunks")
    gen = torch.Generator().manual_seed(7)
    sh = torch.randn(3, 11, 16, generator=gen).to(device).requires_grad_(True)
    sw = torch.randn(64, 16, generator=gen).to(device).requires_grad_(True)
    th, tw = torch.randn(3, 11, 16, generator=gen).to(device), torch.randn(64, 16, generator=gen).to(device)
    outs = []
    for chunk, group in ((8 * 64 * 2, 4 * 64 * 5), (1 << 30, 1 << 30)):  # 2-row chunks, 4-row groups; one of each
        with override(distill_chunk_bytes={"cpu": chunk, "cuda": chunk}, distill_group_bytes={"cpu": group, "cuda": group}):
            assert chunk_plan(torch.device(device), 33, 64, 4) == ((2, 4) if chunk < 1 << 30 else (33, 33))
            div = torch_fused.linear_distill(sh, sw, th, tw, beta=0.3, shift=True)
            outs.append((div,) + torch.autograd.grad(div.sum(), (sh, sw)))
    for a, b in zip(*outs):
        assert (a - b).norm().item() <= 2e-6 * b.norm().item()


@pytest.mark.parametrize("dtype,frozen,vocab", [(torch.bfloat16, False, True), (torch.bfloat16, True, False),
                                               (torch.float32, False, False)])
def test_per_token_backward_takes_vocabulary_chunks_where_they_save_the_accumulator(dtype, frozen, vocab,
                                                                                   monkeypatch):
    """The per-token backward over vocabulary chunks only where the row groups would keep an fp32
    [V, H] d weight accumulator: a 16-bit d weight that is wanted (a frozen head has no d weight;
    an fp32 one accumulates in place). Its results against float64 are test_head_matches_float64's."""
    import torch_fused.ops.distill as D

    calls = []
    real = D._vocab_loop
    monkeypatch.setattr(D, "_vocab_loop", lambda *a: (calls.append(a[7]), real(*a))[1])
    gen = torch.Generator().manual_seed(9)
    sh = torch.randn(18, 16, generator=gen).to(dtype).requires_grad_(True)
    sw = (torch.randn(40, 16, generator=gen) / 2).to(dtype).requires_grad_(not frozen)
    th, tw = torch.randn(18, 16, generator=gen).to(dtype), (torch.randn(40, 16, generator=gen) / 2).to(dtype)
    assert vocab_plan(torch.device("cpu"), 18, 40, 16, 2) is not None  # the budgets would give chunks
    div = torch_fused.linear_distill(sh, sw, th, tw, beta=0.5)
    torch.autograd.grad(div.sum(), [sh] + ([] if frozen else [sw]))
    assert bool(calls) == vocab, calls


def test_chunk_plan_keeps_the_memory_bound():
    """The chunk pair and the d logits group together stay within 1/8 of one [N, V] fp32 logits
    tensor at the benchmark's shapes (past the rows floor), with the shipped CUDA settings."""
    with override(**{k: DEFAULTS[k] for k in ("distill_chunk_bytes", "distill_group_bytes", "distill_min_rows",
                                                "distill_max_extra")}):
        for n in (8192, 16384, 32768):
            for v in (151936, 128256, 32000):
                rows, group = chunk_plan(torch.device("cuda"), n, v, 2)
                assert group % rows == 0 or group >= n
                extra = 8 * rows * v + 2 * group * v
                assert extra <= n * v * 4 / 8, (n, v, rows, group, extra / (n * v * 4))
                assert rows >= 128


def test_vocab_plan_keeps_the_memory_bound():
    """With the shipped CUDA settings, the per-token backward over vocabulary chunks: its logits
    pair, d logits and fp32 d hidden rows within 1/8 of one [N, V] fp32 logits tensor, with no
    [V, H] accumulator; taken at the benchmark's shapes where it gives 2048 columns or more."""
    with override(**{k: DEFAULTS[k] for k in ("distill_chunk_bytes", "distill_group_bytes", "distill_min_rows",
                                                "distill_max_extra", "distill_vocab_min_cols")}):
        taken = {}
        for n in (8192, 16384, 32768):
            for v in (151936, 128256, 32000):
                for hs in (2048, 4096):
                    cols = vocab_plan(torch.device("cuda"), n, v, hs, 2)
                    taken[n, v, hs] = cols
                    if cols is not None:
                        assert 2048 <= cols <= v and cols % 128 == 0
                        assert n * cols * (8 + 2) + n * hs * 4 <= n * v * 4 / 8, (n, v, hs, cols)
        assert taken[8192, 151936, 2048] == 6656 and taken[16384, 128256, 2048] == 5504
        assert taken[32768, 32000, 2048] is None  # 768 columns: the row plan
        # one d logits group covering every row keeps no accumulator: the row plan
        assert vocab_plan(torch.device("cuda"), 128, 151936, 2048, 2) is None


@plain_cpu_only
def test_teacher_gets_no_gradient_and_entropy_none():
    gen = torch.Generator().manual_seed(8)
    s = torch.randn(3, 9, generator=gen, requires_grad=True)
    t = torch.randn(3, 9, generator=gen, requires_grad=True)
    div, ent = torch_fused.distill(s, t, return_entropy=True)
    assert not ent.requires_grad
    ds, dt = torch.autograd.grad(div.sum(), (s, t), allow_unused=True)
    assert dt is None and ds is not None


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_all_ignored(device):
    if INTERPRET:
        pytest.skip("plain CPU")
    s = torch.randn(2, 0, 7, device=device, requires_grad=True)
    assert torch_fused.distill(s, torch.randn(2, 0, 7, device=device)).shape == (2, 0)
    sh = torch.randn(2, 1, 4, device=device, requires_grad=True)
    sw = torch.randn(7, 4, device=device, requires_grad=True)
    out = torch_fused.linear_distill(sh, sw, torch.randn(2, 1, 5, device=device), torch.randn(7, 5, device=device),
                                     shift=True, reduction="token-mean")
    assert out.shape == () and out.item() == 0.0
    lab = torch.full((2, 3), -100, device=device)
    out = torch_fused.linear_distill(torch.randn(2, 3, 4, device=device, requires_grad=True), sw,
                                     torch.randn(2, 3, 5, device=device), torch.randn(7, 5, device=device),
                                     labels=lab, reduction="token-mean")
    assert out.item() == 0.0


# ---------------------------------------------------------------------------------------------
# hypothesis
# ---------------------------------------------------------------------------------------------
@st.composite
def head_cases(draw):
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        beta=draw(st.sampled_from([0.0, 1.0, 0.5, 0.1, 0.9])),
        reduction=draw(st.sampled_from(["none", "token-mean"])),
        t=draw(st.sampled_from([1.0, 0.6, 2.0])),
        shift=draw(st.booleans()),
        bias=draw(st.booleans()),
        sc=draw(st.sampled_from([None, None, 3.0])),
        with_labels=draw(st.booleans()),
        v=draw(st.sampled_from([1, 5, 67, 130])),
        hs=draw(st.sampled_from([4, 16])),
        ht=draw(st.sampled_from([4, 24])),
        l=draw(st.integers(1, 7)),
        seed=draw(st.integers(0, 2**16)),
    )


@plain_cpu_only
@hsettings(max_examples=12)
@given(c=head_cases())
def test_head_property(c):
    _check_head("cpu", c.pop("dtype"), c.pop("beta"), c.pop("reduction"), b=2, **c)


@plain_cpu_only
@hsettings(max_examples=12)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), beta=st.sampled_from([0.0, 1.0, 0.5, 0.25]),
       t=st.sampled_from([1.0, 0.5]), shift=st.booleans(), lab=st.booleans(), v=st.sampled_from([1, 3, 100]),
       seed=st.integers(0, 2**16))
def test_logits_property(dtype, beta, t, shift, lab, v, seed):
    _check_logits("cpu", dtype, beta, t, shift, lab, v=v, seed=seed)


@plain_cpu_only
@hsettings(max_examples=10)
@given(k=st.integers(1, 6), v=st.sampled_from([6, 23]), beta=st.sampled_from([0.0, 1.0, 0.5, 0.2]),
       tail=st.sampled_from(["bucket", "renormalize"]), t=st.sampled_from([1.0, 0.7]), unused=st.booleans(),
       head=st.booleans(), seed=st.integers(0, 2**16))
def test_topk_property(k, v, beta, tail, t, unused, head, seed):
    """A top-k teacher (k up to V, unused slots) against the float64 formula, from logits or from
    the student's head: per-token divergence and d student."""
    gen = torch.Generator().manual_seed(seed)
    ids, lp_t = _topk_inputs(gen, (2, 3), v, min(k, v), "cpu", unused=unused)
    lab = _labels(gen, (2, 3), "cpu")
    g = torch.randn(2, 3, generator=gen)
    if head:
        hs, ws = torch.randn(2, 3, 8, generator=gen, requires_grad=True), torch.randn(v, 8, generator=gen)
        out = torch_fused.linear_distill(hs, ws, teacher_topk_ids=ids, teacher_topk_logprobs=lp_t, beta=beta,
                                         temperature=t, labels=lab, tail=tail)
        x, zs = hs, lambda a: (a.double() @ ws.double().t()) / t
    else:
        x = (torch.randn(2, 3, v, generator=gen) * 2).requires_grad_(True)
        out = torch_fused.distill(x, teacher_topk_ids=ids, teacher_topk_logprobs=lp_t, beta=beta, temperature=t,
                                  labels=lab, tail=tail)
        zs = lambda a: a.double() / t  # noqa: E731
    (dx,) = torch.autograd.grad((out * g).sum(), x)
    xd = x.detach().double().requires_grad_(True)
    ref = _topk_ref(zs(xd), ids, lp_t, beta, tail, lab)
    (rdx,) = torch.autograd.grad((ref * g.double()).sum(), xd)
    assert_div_close(out, ref, v, f"top-k k={k} beta={beta} {tail}")
    assert_grad_rel(dx, rdx, torch.float32, f"top-k d student k={k} beta={beta} {tail}")


# ---------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile, errors, out-of-range ids
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    if INTERPRET:
        pytest.skip("plain CPU (the opcheck of the kernels' ops runs on CUDA)")
    gen = torch.Generator().manual_seed(2)
    OPS = torch.ops.fused
    s = torch.randn(2, 5, 13, generator=gen).to(device).requires_grad_(True)
    t = torch.randn(2, 5, 13, generator=gen).to(device)
    lab = torch.tensor([[1, -100, 2, 3], [4, 5, -100, 6]], device=device)
    for beta in (0.0, 0.4, 1.0):
        opts = DistillOptions(beta=beta, shift=True)
        torch.library.opcheck(OPS._distill_forward, (s, t, lab, *opts.values()))
        div, _, stats = OPS._distill_forward(s, t, lab, *opts.values())
        torch.library.opcheck(OPS._distill_backward,
                              (torch.randn_like(div), s.detach(), t, lab, stats.detach(), *opts.values()))
    torch.library.opcheck(OPS.distill, (s, t), {"labels": lab, "shift": True, "reduction": "token-mean"})
    ids = torch.randint(0, 13, (2, 4, 3), generator=gen).to(device)
    lpt = torch.randn(2, 4, 3, generator=gen).to(device) - 3
    torch.library.opcheck(OPS.distill, (s,), {"teacher_topk_ids": ids, "teacher_topk_logprobs": lpt, "shift": True})
    sh = torch.randn(2, 5, 8, generator=gen).to(device).requires_grad_(True)
    sw = torch.randn(13, 8, generator=gen).to(device).requires_grad_(True)
    sb = torch.randn(13, generator=gen).to(device).requires_grad_(True)
    th, tw = torch.randn(2, 5, 6, generator=gen).to(device), torch.randn(13, 6, generator=gen).to(device)
    for red in ("none", "token-mean"):
        opts = DistillOptions(beta=0.3, shift=True, reduction=red, student_softcap=4.0, teacher_logit_scale=0.5)
        args = (sh, sw, sb, th, tw, None, lab, *opts.values())
        torch.library.opcheck(OPS._linear_distill_forward, args,
                              {"hidden_grad": True, "weight_grad": True, "bias_grad": True})
    opts = DistillOptions(beta=0.3, shift=True)
    div, _, stats, *_ = OPS._linear_distill_forward(sh, sw, sb, th, tw, None, lab, *opts.values())
    torch.library.opcheck(OPS._linear_distill_backward, (torch.randn_like(div), sh.detach(), sw.detach(), sb.detach(),
                                                         th, tw, None, lab, stats.detach(), *opts.values()))
    torch.library.opcheck(OPS.linear_distill, (sh, sw, th, tw), {"labels": lab, "shift": True, "student_bias": sb})


def test_gradcheck_float64():
    if INTERPRET:
        pytest.skip("plain CPU")
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    for beta in (0.0, 0.6, 1.0):
        assert torch.autograd.gradcheck(lambda x: torch_fused.distill(x, t, beta=beta, temperature=0.9, shift=True), (s,))
    sh = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    sw = torch.randn(9, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    th, tw = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64), torch.randn(9, 3, generator=gen, dtype=torch.float64)
    for red in ("none", "token-mean"):
        assert torch.autograd.gradcheck(
            lambda a, b: torch_fused.linear_distill(a, b, th, tw, beta=0.7, reduction=red, student_softcap=2.0),
            (sh, sw))


def _recompile_check(fn, make, lengths):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager" if INTERPRET else "inductor")
    step = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    frames = []
    for length in lengths:
        args, leaves = make(length)
        out = step(*args)
        grads = torch.autograd.grad(out, leaves)
        ref = fn(*args)
        rgrads = torch.autograd.grad(ref, leaves)
        torch.testing.assert_close(out, ref)
        for a, b in zip(grads, rgrads):
            torch.testing.assert_close(a, b)
        frames.append(cnt.frame_count)
    assert frames[0] == frames[-1], f"recompiled across sequence lengths: frames {frames}"


@plain_cpu_only
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what", ["logits", "head-none", "head-token-mean", "topk-head"])
def test_compile_fullgraph_dynamic_no_recompile(what, device):
    w = torch.randn(40, 8, device=device, requires_grad=True)
    tw = torch.randn(40, 6, device=device)

    def make(length):
        g = torch.Generator().manual_seed(length)
        lab = torch.randint(0, 40, (2, length), generator=g)
        lab[0, 0] = -100
        lab = lab.to(device)
        if what == "logits":
            s = torch.randn(2, length + 1, 40, generator=g).to(device).requires_grad_(True)
            return (s, torch.randn(2, length + 1, 40, generator=g).to(device), lab), (s,)
        h = torch.randn(2, length + 1, 8, generator=g).to(device).requires_grad_(True)
        if what == "topk-head":
            ids = torch.randint(0, 40, (2, length, 7), generator=g)  # (k = 7: no size of L or L+1, so no duck sizing)
            return (h, ids.to(device), (torch.randn(2, length, 7, generator=g) - 4).to(device), lab), (h, w)
        return (h, torch.randn(2, length + 1, 6, generator=g).to(device), lab), (h, w)

    def fn(*args):
        if what == "logits":
            s, t, lab = args
            div, ent = torch_fused.distill(s, t, beta=0.4, labels=lab, shift=True, return_entropy=True)
            return div.sum() + 0.0 * ent.sum()
        if what == "topk-head":
            h, ids, lpt, lab = args
            return torch_fused.linear_distill(h, w, teacher_topk_ids=ids, teacher_topk_logprobs=lpt, labels=lab,
                                              shift=True, reduction="token-mean", beta=0.2)
        h, th, lab = args
        out = torch_fused.linear_distill(h, w, th, tw, beta=0.6, labels=lab, shift=True,
                                         reduction=what.removeprefix("head-"))
        return out if out.dim() == 0 else (out * 1.5).sum()

    _recompile_check(fn, make, (3, 5, 9))


BAD = [
    ("beta", "logits", {"beta": 1.5}, r"beta: expected a number in \[0, 1\]"),
    ("temperature", "logits", {"temperature": 0.0}, r"temperature: expected a positive finite number, got 0.0"),
    ("reduction", "logits", {"reduction": "mean"}, r"reduction: expected one of 'none', 'sum', 'token-mean'"),
    ("vocab", "logits-vocab", {}, r"teacher_logits: vocabulary size 6 .* differs from the student's 7"),
    ("labels shape", "logits", {"labels": torch.zeros(3, dtype=torch.long)}, r"labels: expected shape \(2,\)"),
    ("labels dtype", "logits", {"labels": torch.zeros(2)}, r"labels: expected dtype int32 or int64"),
    ("no teacher", "logits-none", {}, r"distill: teacher_logits is required"),
    ("both teachers", "logits", {"teacher_topk_ids": torch.zeros(2, 1, dtype=torch.long),
                                 "teacher_topk_logprobs": torch.zeros(2, 1)}, r"pass either the full teacher"),
    ("tail", "topk", {"tail": "drop"}, r"tail: expected one of 'bucket', 'renormalize'"),
    ("topk shape", "topk-shape", {}, r"teacher_topk_ids: expected shape \(2, 'k'\)"),
    ("topk logprobs", "topk-lp", {}, r"teacher_topk_logprobs: expected teacher_topk_ids' shape"),
    ("head vocab", "head-vocab", {}, r"teacher_weight: vocabulary size 9 .* differs from the student's 7"),
    ("head rows", "head-rows", {}, r"teacher_hidden: expected the student_hidden's leading shape \(2,\)"),
    ("head hidden", "head-hidden", {}, r"teacher_weight: hidden size 4 .* differs from teacher_hidden's last dim 5"),
    ("softcap", "head", {"student_softcap": -1.0}, r"student_softcap: expected None or a positive finite number"),
    ("scale", "head", {"teacher_logit_scale": float("inf")}, r"teacher_logit_scale: expected a positive finite"),
    # the float and bool keywords' types (a tensor would lose its gradient in the op's float)
    ("tensor temperature", "logits", {"temperature": torch.tensor(2.0)}, r"temperature: distill takes a float"),
    ("tensor beta", "head", {"beta": torch.tensor(0.5)}, r"beta: linear_distill takes a float beta"),
    ("bool beta", "logits", {"beta": True}, r"beta: expected a number, got True"),
    ("None scale", "head", {"student_logit_scale": None}, r"student_logit_scale: expected a number, got None"),
    ("bool softcap", "head", {"teacher_softcap": True}, r"teacher_softcap: expected a number or None, got True"),
    ("return_entropy", "logits", {"return_entropy": "no"}, r"return_entropy: expected a bool, got 'no'"),
    # a keyword that does not apply to the call
    ("tail, full teacher", "logits", {"tail": "drop"}, r"tail: expected one of 'bucket', 'renormalize'"),
    ("both teachers, head", "head", {"teacher_topk_ids": torch.zeros(2, 1, dtype=torch.long),
                                     "teacher_topk_logprobs": torch.zeros(2, 1)},
     r"linear_distill: pass either the full teacher"),
    ("top-k teacher softcap", "head-topk", {"teacher_softcap": 3.0}, r"teacher_logit_scale, teacher_softcap: a top-k"),
]


@plain_cpu_only
@pytest.mark.parametrize("name,kind,kw,msg", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bad_input_clear_error(name, kind, kw, msg, mode):
    s, t = torch.randn(2, 7), torch.randn(2, 7)
    sh, sw, th, tw = torch.randn(2, 4), torch.randn(7, 4), torch.randn(2, 5), torch.randn(7, 5)
    ids, lpt = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3) - 2

    def f(*args):
        if kind.startswith("logits"):
            teacher = {"logits-vocab": torch.randn(2, 6), "logits-none": None}.get(kind, args[1])
            return torch_fused.distill(args[0], teacher, **kw)
        if kind.startswith("topk"):
            i = torch.zeros(3, 3, dtype=torch.long) if kind == "topk-shape" else ids
            lp = torch.zeros(2, 2) if kind == "topk-lp" else lpt
            return torch_fused.distill(args[0], teacher_topk_ids=i, teacher_topk_logprobs=lp, **kw)
        a = dict(zip(("sh", "sw", "th", "tw"), args[2:]))
        if kind == "head-topk":
            return torch_fused.linear_distill(a["sh"], a["sw"], teacher_topk_ids=ids, teacher_topk_logprobs=lpt, **kw)
        if kind == "head-vocab":
            a["tw"] = torch.randn(9, 5)
        if kind == "head-rows":
            a["th"] = torch.randn(3, 5)
        if kind == "head-hidden":
            a["tw"] = torch.randn(7, 4)
        return torch_fused.linear_distill(a["sh"], a["sw"], a["th"], a["tw"], **kw)

    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=msg):
        f(s, t, sh, sw, th, tw)


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_topk_id_stays_in_its_row(device):
    """A top-k id outside [0, V): IndexError on the plain CPU path (the log-prob ops' check); on
    the kernel path (CUDA, the interpreter) NaN at its position and a NaN gradient row only,
    every other position as with the id unused. A label value is only compared with
    ignore_index: any other value keeps its position."""
    gen = torch.Generator().manual_seed(12)
    v = 20
    s = torch.randn(4, v, generator=gen).to(device)
    ids, lpt = _topk_inputs(gen, (1, 4), v, 3, device, unused=False)
    ids, lpt = ids[0], lpt[0]
    bad = ids.clone()
    bad[1, 0] = v + 5
    if device == "cpu" and not INTERPRET:
        with pytest.raises(IndexError, match=r"index: value 25 is outside \[0, V=20\)"):
            torch_fused.distill(s, teacher_topk_ids=bad, teacher_topk_logprobs=lpt)
        return
    unused = ids.clone()
    unused[1, 0] = -100

    def run(i):
        x = s.clone().requires_grad_(True)
        div = torch_fused.distill(x, teacher_topk_ids=i, teacher_topk_logprobs=lpt, beta=0.5,
                                  labels=torch.tensor([10**9, 3, -5, 0], device=device))
        return div, torch.autograd.grad(div.nan_to_num().sum(), x)[0]

    d, g = run(bad)
    d0, g0 = run(unused)
    rest = torch.arange(4, device=device) != 1
    assert torch.isnan(d[1]) and torch.isnan(g[1]).all()
    torch.testing.assert_close(d[rest], d0[rest])
    torch.testing.assert_close(g[rest], g0[rest])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("model", ["student", "teacher"])
def test_nonfinite_rows_stay_in_their_rows(beta, model):
    """A NaN logit in one row of either model: NaN divergence there only (the kernels' p > 0
    masks would otherwise drop the NaN lane and report a finite divergence), and a gradient row
    with NaN in it; an ignored NaN row: 0 and a zero gradient row."""
    gen = torch.Generator().manual_seed(13)
    s, t = torch.randn(3, 11, generator=gen), torch.randn(3, 11, generator=gen)
    (s if model == "student" else t)[1, 4] = float("nan")
    s.requires_grad_(True)
    div = torch_fused.distill(s, t, beta=beta)
    assert torch.isnan(div[1]) and torch.isfinite(div[[0, 2]]).all(), div
    (ds,) = torch.autograd.grad(div[[0, 2]].sum() + div[1], s)
    assert torch.isnan(ds[1]).any() and torch.isfinite(ds[[0, 2]]).all()
    div = torch_fused.distill(s, t, beta=beta, labels=torch.tensor([0, -100, 0]))
    assert div[1] == 0 and torch.isfinite(div).all()
    (ds,) = torch.autograd.grad(div.sum(), s)
    assert bool((ds[1] == 0).all()) and torch.isfinite(ds).all()


# ---------------------------------------------------------------------------------------------
# CUDA at the shipped settings
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def shipped_settings():
    """The shipped distill_* settings (instead of this module's small chunks)."""
    with override(**{k: v for k, v in DEFAULTS.items() if k.startswith("distill_")}):
        yield


@pytest.mark.cuda
@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["none", "token-mean"])
def test_cuda_head_at_shipped_settings(beta, reduction, scale, shipped_settings):
    """bf16 heads of a realistic width at the shipped chunk, group and segment sizes (several chunks
    and segments at N = 4096): the per-token divergence within 1e-5 nats of the float64
    materialized formula of the same bf16 inputs, the gradients within about one bf16 rounding.
    Logits of standard deviation 3 (divergences of 15-18 nats at beta 0 and 1): there an fp32
    GEMM's logits alone, through the float64 formula, are 1.0-1.1e-5 nats off on an H100, so the
    bound is 1e-5 nats beyond that GEMM's own error."""
    gen = torch.Generator().manual_seed(21)
    n, v, hs, ht = 4096, 32000, 256, 384
    dev = "cuda"
    sh = (torch.randn(n, hs, generator=gen)).to(dev, torch.bfloat16).requires_grad_(True)
    sw = (torch.randn(v, hs, generator=gen) / hs ** 0.5 * scale).to(dev, torch.bfloat16).requires_grad_(True)
    th = torch.randn(n, ht, generator=gen).to(dev, torch.bfloat16)
    tw = (torch.randn(v, ht, generator=gen) / ht ** 0.5 * scale).to(dev, torch.bfloat16)
    lab = _labels(gen, (n,), dev)
    out = torch_fused.linear_distill(sh, sw, th, tw, beta=beta, labels=lab, reduction=reduction)
    loss = out.sum() if reduction == "none" else out
    dh, dw = torch.autograd.grad(loss, (sh, sw))
    hd, wd = sh.detach().double().requires_grad_(True), sw.detach().double().requires_grad_(True)
    rdiv, _ = ref_head(hd, wd, th, tw, beta, 1.0, False)
    rdiv = torch.where(lab != -100, rdiv, torch.zeros_like(rdiv))
    rout = rdiv if reduction == "none" else rdiv.sum() / (lab != -100).sum()
    rdh, rdw = torch.autograd.grad(rout.sum(), (hd, wd))
    err = (out.double() - rout).abs().max().item()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():  # the error an fp32 GEMM's logits (no TF32) carry into the float64 formula
            r32 = ref_divergence(sh.detach().float() @ sw.detach().float().t(), th.float() @ tw.float().t(), beta)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    r32 = torch.where(lab != -100, r32.double(), torch.zeros_like(rdiv))
    r32 = r32 if reduction == "none" else r32.sum() / (lab != -100).sum()
    gemm_err = (r32 - rout).abs().max().item()
    assert gemm_err < 3e-5, f"the fp32 GEMM's own error {gemm_err:.3g}: not an fp32 GEMM (TF32?)"
    bound = 1e-5 if scale == 1.0 else 1e-5 + gemm_err
    assert err <= bound, (f"divergence error {err:.3g} > {bound:.3g} (largest value {rout.abs().max().item():.3g} "
                          f"nats; fp32-GEMM logits then float64: {gemm_err:.3g})")
    assert_grad_rel(dh, rdh, torch.bfloat16, "d hidden")
    assert_grad_rel(dw, rdw, torch.bfloat16, "d weight")


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["none", "token-mean"])
def test_cuda_head_peak_memory(reduction, shipped_settings):
    """Peak memory of a forward and backward beyond the inputs and the gradients it returns: at
    most 1/8 of one [N, V] fp32 logits tensor (the chunk pair and the d logits group), plus the
    fp32 d weight accumulator [V, H] and the fp32 d hidden rows [N, H] (the reduced mode keeps
    both until its backward, and its fp32 d hidden in the input's shape), plus 16 MiB of O(N)
    statistics and allocator rounding."""
    gen = torch.Generator().manual_seed(22)
    n, v, hs, ht = 8192, 32000, 512, 768
    dev = "cuda"
    sh = torch.randn(n, hs, generator=gen).to(dev, torch.bfloat16).requires_grad_(True)
    sw = (torch.randn(v, hs, generator=gen) / 8).to(dev, torch.bfloat16).requires_grad_(True)
    th = torch.randn(n, ht, generator=gen).to(dev, torch.bfloat16)
    tw = (torch.randn(v, ht, generator=gen) / 8).to(dev, torch.bfloat16)
    for warm in (True, False):  # the first call: cuBLAS workspaces and kernel compiles, outside the measure
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = torch_fused.linear_distill(sh, sw, th, tw, beta=0.5, reduction=reduction)
        grads = torch.autograd.grad(out.sum(), (sh, sw))
        if warm:
            del out, grads
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads)
    bound = n * v * 4 / 8 + v * hs * 4 + 2 * n * hs * 4 + (16 << 20)
    assert peak <= bound, f"peak extra {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"


@pytest.mark.cuda
def test_cuda_head_per_token_peak_memory_without_accumulator(shipped_settings):
    """Per token at a shape whose backward runs over vocabulary chunks (vocab_plan: 3072 columns):
    peak memory beyond the inputs and the returned gradients within 1/8 of one [N, V] fp32 logits
    tensor (the forward's chunk pair and group; the backward's logits pair, d logits and fp32 d
    hidden rows), with no fp32 [V, H] d weight accumulator, plus 16 MiB."""
    gen = torch.Generator().manual_seed(23)
    n, v, hs, ht = 8192, 65536, 512, 768
    dev = "cuda"
    assert vocab_plan(torch.device(dev), n, v, hs, 2) == 3072
    sh = torch.randn(n, hs, generator=gen).to(dev, torch.bfloat16).requires_grad_(True)
    sw = (torch.randn(v, hs, generator=gen) / 8).to(dev, torch.bfloat16).requires_grad_(True)
    th = torch.randn(n, ht, generator=gen).to(dev, torch.bfloat16)
    tw = (torch.randn(v, ht, generator=gen) / 8).to(dev, torch.bfloat16)
    for warm in (True, False):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = torch_fused.linear_distill(sh, sw, th, tw, beta=0.5)
        grads = torch.autograd.grad(out.sum(), (sh, sw))
        if warm:
            del out, grads
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads)
    bound = n * v * 4 / 8 + (16 << 20)
    assert peak <= bound, f"peak extra {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"


@pytest.mark.cuda
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_cuda_logits_bf16_vocabulary_size(beta):
    """The logits kernels on bf16 rows of a 151936-token vocabulary (a full block prefix and a
    ragged tail), strided (shifted) and against a float32 teacher: per-token divergence within
    1e-5 nats of float64, the gradient written once in bf16."""
    _check_logits("cuda", torch.bfloat16, beta, 1.0, True, True, v=151936, b=2, l=9, teacher_dtype=torch.float32)
