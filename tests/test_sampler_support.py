"""Log-probs and entropy over the sampler's support (top_k, top_p, min_p), against a float64
reference written the way vLLM's sampler computes it (ascending sort, cumulative sum)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fused
from _helpers import DEVICES
from torch_fused._library import INTERPRET

NINF = float("-inf")


def _vllm_support(x, temperature, top_k, top_p, min_p):
    """Keep mask of the sampler's support, float64: min-p, top-k, top-p in that order."""
    z = x.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p is not None and min_p > 0:
        p = torch.softmax(z, -1)
        keep &= p >= min_p * p.amax(-1, keepdim=True)
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        keep &= z >= kth
    if top_p is not None and top_p < 1:
        zk = torch.where(keep, z, NINF)
        srt, order = zk.sort(-1)  # ascending
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # the largest is always kept
        keep &= ~torch.zeros_like(drop).scatter(-1, order, drop)
    return keep


def _reference(x, idx, temperature, top_k, top_p, min_p, ignore_index=-100):
    """(logp, entropy) in float64 over the support; -inf at ids outside it, 0 at ignore_index."""
    keep = _vllm_support(x, temperature, top_k, top_p, min_p)
    lp_all = torch.log_softmax(torch.where(keep, x.double() / temperature, NINF), -1)
    ent = -(lp_all.exp() * lp_all.nan_to_num(0.0, 0.0, 0.0)).sum(-1)
    ids = idx if idx.dim() == x.dim() else idx[..., None]
    lp = lp_all.gather(-1, ids.clamp_min(0))
    lp = torch.where(ids == ignore_index, torch.zeros_like(lp), lp)
    return (lp if idx.dim() == x.dim() else lp[..., 0]), ent, keep


@pytest.mark.skipif(INTERPRET, reason="float64 logits take the reference path: the plain CPU run covers it")
@given(seed=st.integers(0, 2**16), v=st.sampled_from([7, 50, 131]), top_k=st.sampled_from([None, 1, 3, 20, 200]),
       top_p=st.sampled_from([None, 0.3, 0.9, 1.0]), min_p=st.sampled_from([None, 0.0, 0.05, 0.5]),
       temperature=st.sampled_from([0.6, 1.0, 1.7]), k_ids=st.sampled_from([None, 3]), shift=st.booleans())
def test_matches_the_samplers_rule_in_float64(seed, v, top_k, top_p, min_p, temperature, k_ids, shift):
    """float64 logits: the support, the log-probs (-inf outside it) and the entropy of the
    renormalized distribution equal the float64 rule; the gradient flows through kept logits only."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 5, v, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    rows = x[:, :-1] if shift else x
    shape = rows.shape[:-1] + ((k_ids,) if k_ids else ())
    idx = torch.randint(0, v, shape, generator=g)
    if k_ids is None:
        idx[0, 0] = -100
    lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                               shift=shift)
    rlp, rent, keep = _reference(rows.detach(), idx, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isneginf(lp), torch.isneginf(rlp)), (lp, rlp)
    fin = torch.isfinite(rlp)
    torch.testing.assert_close(lp[fin], rlp[fin], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, rent, rtol=1e-12, atol=1e-12)
    gl = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    ge = torch.randn(ent.shape, generator=g, dtype=torch.float64)
    (dx,) = torch.autograd.grad((torch.where(fin, lp, 0.0) * gl).sum() + (ent * ge).sum(), x)
    xr = rows.detach().clone().requires_grad_(True)
    z = torch.where(keep, xr / temperature, NINF)
    lp_all = torch.log_softmax(z, -1)
    ids = idx if k_ids else idx[..., None]
    want_lp = torch.where(ids == -100, 0.0, lp_all.gather(-1, ids.clamp_min(0)))
    want_lp = want_lp if k_ids else want_lp[..., 0]
    want_ent = -(lp_all.exp() * torch.where(keep, lp_all, 0.0)).sum(-1)
    (want,) = torch.autograd.grad((torch.where(fin, want_lp, 0.0) * gl).sum() + (want_ent * ge).sum(), xr)
    dx_rows = dx[:, :-1] if shift else dx
    torch.testing.assert_close(dx_rows, want, rtol=1e-10, atol=1e-12)
    assert bool((dx_rows[~keep] == 0).all())  # nothing reaches a logit outside the support
    if shift:
        assert bool((dx[:, -1] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_dtypes_and_a_tensor_temperature(device, dtype):
    """fp32 / bf16 logits (the kernels' path on CUDA and in the interpreter run) and a tensor
    temperature: the same support as the float64 rule on the rounded logits, log-probs and entropy
    to fp32 accuracy, d T through the kept logits."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 4, 97, generator=g) * 3).to(dtype)
    idx = torch.randint(0, 97, (3, 4), generator=g)
    t = torch.tensor(0.8, device=device, requires_grad=True)
    xd = x.to(device).requires_grad_(True)
    lp, ent = torch_fused.logprobs_and_entropy(xd, idx.to(device), temperature=t, top_k=20, top_p=0.85, min_p=0.02)
    rlp, rent, _ = _reference(x.float(), idx, 0.8, 20, 0.85, 0.02)
    assert torch.equal(torch.isneginf(lp).cpu(), torch.isneginf(rlp))
    fin = torch.isfinite(rlp)
    torch.testing.assert_close(lp.cpu()[fin].double(), rlp[fin], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.cpu().double(), rent, rtol=2e-5, atol=2e-5)
    (dt,) = torch.autograd.grad((torch.where(fin.to(device), lp, 0.0)).sum() + ent.sum(), t)
    tr = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    keep = _vllm_support(x.float(), 0.8, 20, 0.85, 0.02)
    lp_all = torch.log_softmax(torch.where(keep, x.double() / tr, NINF), -1)
    want = torch.autograd.grad(torch.where(fin, lp_all.gather(-1, idx[..., None])[..., 0], 0.0).sum()
                               - (lp_all.exp() * torch.where(keep, lp_all, 0.0)).sum(), tr)[0]
    assert abs(dt.item() - want.item()) <= 1e-4 * abs(want.item()) + 1e-5, (dt.item(), want.item())


def test_ties_at_the_top_k_threshold_are_kept():
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    lp = torch_fused.selective_log_softmax(x, torch.tensor([4]), top_k=2)
    ent = torch_fused.entropy_from_logits(x, top_k=2)
    # the 2nd largest (1.0) is tied three ways: all three kept, 0.0 dropped
    assert lp.item() == NINF
    p = torch.softmax(torch.tensor([3.0, 1.0, 1.0, 1.0], dtype=torch.float64), -1)
    assert abs(ent.item() - float(-(p * p.log()).sum())) < 1e-6


def test_without_options_it_is_the_full_vocabulary_op():
    """top_p=1 and min_p=0 leave the vocabulary whole: bitwise the plain op's results."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 33, generator=g)
    idx = torch.randint(0, 33, (4,), generator=g)
    plain = torch_fused.logprobs_and_entropy(x, idx)
    for kw in (dict(top_p=1.0), dict(min_p=0.0), dict(top_p=1.0, min_p=0.0), dict(top_k=33)):
        got = torch_fused.logprobs_and_entropy(x, idx, **kw)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), kw


@pytest.mark.parametrize("kw,msg", [(dict(top_k=0), "top_k: expected None or an int >= 1, got 0"),
                                    (dict(top_k=True), "top_k: expected None or an int >= 1, got True"),
                                    (dict(top_p=0.0), r"top_p: expected None or a number in \(0, 1\], got 0.0"),
                                    (dict(top_p=1.5), r"top_p: expected None or a number in \(0, 1\], got 1.5"),
                                    (dict(min_p=-0.1), r"min_p: expected None or a number in \[0, 1\], got -0.1"),
                                    (dict(top_k=torch.tensor(3)), r"top_k: expected .*, got a tensor of shape \(\)"),
                                    (dict(top_k=2**63), r"top_k: expected an int64 value, got 9223372036854775808")],
                         ids=["top_k 0", "top_k bool", "top_p 0", "top_p 1.5", "min_p negative", "top_k tensor",
                              "top_k 2**63"])
@pytest.mark.parametrize("mode", ["eager", "op", "compiled"])
def test_bad_options_name_the_argument(kw, msg, mode):
    x, idx = torch.randn(2, 9), torch.randint(0, 9, (2,))
    if mode == "eager":
        fn = torch_fused.selective_log_softmax
    elif mode == "op":
        def fn(x, idx, **k):
            return torch.ops.fused.selective_log_softmax(x, idx, **k)
        if "top_k" in kw and (type(kw["top_k"]) is not int or kw["top_k"] >= 2**63):
            pytest.skip("the op's schema refuses a bool, a tensor or an int past int64 for its int")
    else:
        torch._dynamo.reset()
        fn = torch.compile(lambda x, idx, **k: torch_fused.selective_log_softmax(x, idx, **k), backend="aot_eager",
                           fullgraph=True)
    # compiled with fullgraph, Dynamo re-raises the same message inside its own exception type
    with pytest.raises(ValueError if mode != "compiled" else Exception, match=msg):
        fn(x, idx, **kw)


@pytest.mark.skipif(INTERPRET, reason="the composite and its tracing: the plain CPU run covers it (the kernels run "
                                       "in the dtype test)")
def test_op_opcheck_and_compiled_dynamic_without_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 40, generator=g, requires_grad=True)
    idx = torch.randint(0, 40, (2, 5), generator=g)
    torch.library.opcheck(torch.ops.fused.logprobs_and_entropy, (x, idx),
                          dict(shift=True, top_k=7, top_p=0.8, min_p=0.01))

    def loss(x, idx):
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, shift=True, top_k=7, top_p=0.8)
        return torch.where(torch.isfinite(lp), lp, 0.0).sum() + ent.sum()

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    step = torch.compile(loss, backend=cnt, fullgraph=True, dynamic=True)
    for length in (5, 8, 11):
        xl = torch.randn(2, length + 1, 40, generator=g, requires_grad=True)
        il = torch.randint(0, 40, (2, length), generator=g)
        got = step(xl, il)
        (dx,) = torch.autograd.grad(got, xl)
        want = loss(xl, il)
        (wdx,) = torch.autograd.grad(want, xl)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(dx, wdx)
    assert cnt.frame_count == 1, cnt.frame_count


@pytest.mark.parametrize("device", DEVICES)
def test_an_id_outside_the_support_gets_no_gradient(device):
    """An id outside the support scores -inf and its log-prob passes no gradient to any logit
    (the core formula alone would give - p_j to every kept logit)."""
    x = torch.tensor([[4.0, 3.0, 0.0, -1.0, 2.0]], device=device, requires_grad=True)
    idx = torch.tensor([[3, 0]], device=device)
    lp = torch_fused.selective_log_softmax(x, idx, top_k=2)
    assert lp[0, 0].item() == NINF and torch.isfinite(lp[0, 1])
    (dx,) = torch.autograd.grad(lp[0, 0], x, retain_graph=True)
    assert bool((dx == 0).all()), dx
    (dx,) = torch.autograd.grad(lp[0, 1], x)
    p = torch.softmax(torch.tensor([4.0, 3.0], dtype=torch.float64), -1)
    want = torch.tensor([1 - p[0], -p[1], 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(dx[0].double().cpu(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The thresholds' kernels (kernels/sampler.py) against the rule (reference.sampler_threshold):
# in the interpreter run at small V with the small tiles (several blocks, list shrinks and
# overflows, several rows per program), and on CUDA at the benchmark's vocabularies.
# ---------------------------------------------------------------------------------------------
KERNEL_PATH = pytest.mark.skipif(not INTERPRET, reason="the thresholds' kernels: the interpreter run and CUDA")


def _rows_with_hard_cases(rows, v, dtype, device, seed):
    """rows x v logits (randn * 3) whose first four rows are the hard cases: all equal, half -inf,
    the top value tied across a third of the row, the 5th largest tied across a quarter of it;
    the fifth row is an ordinary one shifted below zero (negative thresholds)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, v, generator=g, dtype=torch.float64) * 3
    x[0] = 1.25
    x[1, ::2] = NINF
    x[2, : v // 3] = x[2].max() + 1
    x[3, 1::4] = torch.sort(x[3], descending=True).values[4]
    x[4] -= 30
    return x.to(dtype).to(device)


def _cut_margin(x, temperature, top_k, top_p, min_p):
    """Per row, the float64 distance of the top-p cut's cumulative mass from top_p (inf without
    top-p): a row closer than fp32 rounding can tell may be cut one id apart by the kernels' sums
    and the rule's cumsum."""
    z = x.double() / temperature
    keep = _vllm_support(x, temperature, top_k, None, min_p)
    if top_p is None or top_p >= 1:
        return torch.full(z.shape[:-1], float("inf"), dtype=torch.float64)
    p = torch.softmax(torch.where(keep, z, NINF), -1)
    srt = p.sort(-1, descending=True).values
    before = srt.cumsum(-1) - srt
    return (before - top_p).abs().amin(-1)


def _top_p_cut_is_valid(x, temperature, top_p, tau, delta=1e-4):
    """Per row, whether threshold tau is a top-p cut of the rule within ``delta`` of mass (float64):
    the mass strictly above tau is below top_p (the last kept id had less than top_p before it)
    and with the ids at tau it reaches top_p (the next id would not be kept). At V 151936 an id
    around a randn row's cut holds about 1.2e-5 of the mass and the rule's own fp32 cut (a
    cumsum of fp32 probabilities) lies up to 4e-5 from float64's, so 1e-4 (about eight ids)
    accepts fp32 rounding and catches a cut that is wrong by more."""
    xf = x.cpu().float()
    p = torch.softmax(xf.double() / float(temperature), -1)
    t = tau.cpu()[:, None]
    above = (p * (xf > t)).sum(-1)
    at = (p * (xf == t)).sum(-1)
    return (above < top_p + delta) & (above + at >= top_p - delta) & (at > 0)


def _check_thresholds(x, temperature, top_k, top_p, min_p, tau, support, margin=1e-5):
    """tau equals the rule's on every row but those whose top-p cut is within ``margin`` of
    top_p; the listed rows list exactly the ids >= tau, in order."""
    from torch_fused.meta.logprobs import LogprobOptions

    t_t = temperature if isinstance(temperature, torch.Tensor) else None
    opts = LogprobOptions(temperature=1.0 if t_t is not None else temperature, top_k=top_k, top_p=top_p,
                          min_p=min_p)
    want = torch_fused.reference.sampler_threshold(x.cpu(), None if t_t is None else t_t.cpu(), opts)
    tv = float(temperature)
    clear = _cut_margin(x.cpu().float(), tv, top_k, top_p, min_p) > margin
    got = tau.cpu()
    assert torch.equal(got[clear], want[clear]), (torch.nonzero(got != want), got[got != want], want[got != want])
    xf = x.cpu().float()
    for r in range(x.shape[0]):
        n = int(support[r, 0])
        if n >= 0:
            kept = torch.nonzero(xf[r] >= got[r])[:, 0]
            assert n == len(kept) and torch.equal(support[r, 1:1 + n].cpu().long(), kept), r
    return clear


# the filter kernel's forms: (sampler_filter_one_pass, sampler_filter_split); the split forms run
# the top-p kernel's appending band pass too (sampler_top_p_append)
ONE_PASS = pytest.mark.parametrize("one_pass", [(True, False), (False, False), (True, True), (False, True)],
                                   ids=["one-pass", "two-pass", "one-pass-split", "two-pass-split"])
TOP_P_APPEND = pytest.mark.parametrize("append", [False, True], ids=["ordered-band", "appended-band"])


def _filter_form(settings_override, form):
    settings_override(sampler_filter_one_pass=form[0], sampler_filter_split=form[1], sampler_top_p_append=form[1])


def _threshold_cases():
    cases = [(torch.bfloat16, 1.0, dict(min_p=0.05)), (torch.bfloat16, 1.0, dict(top_k=5)),
             (torch.bfloat16, 0.7, dict(top_p=0.8)), (torch.float32, "tensor", dict(top_k=3, top_p=0.9, min_p=0.02))]
    return [pytest.param(d, t, kw, id=f"{str(d)[6:]}-T{t}-{'-'.join(f'{k}{v}' for k, v in kw.items())}")
            for d, t, kw in cases]


@KERNEL_PATH
@ONE_PASS
@pytest.mark.parametrize("dtype,temperature,kw", _threshold_cases())
def test_threshold_kernels_match_the_rule(dtype, temperature, kw, one_pass, settings_override):
    """The fast route (finish=False: what it settles alone) and the whole op give the rule's
    thresholds, the fast route settles the ordinary rows itself (the hard rows may fall to the
    exact kernel), and the support lists list exactly the kept ids; with the filter's one pass
    and its two."""
    from torch_fused.ops.sampler import threshold_launches

    _filter_form(settings_override, one_pass)

    x = _rows_with_hard_cases(6, 40, dtype, "cpu", seed=7)
    t = torch.tensor(0.7) if temperature == "tensor" else temperature
    args = (x, t if isinstance(t, torch.Tensor) else None, 1.0 if isinstance(t, torch.Tensor) else t, False,
            kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
    tau, sup, finish = threshold_launches(*args, finish=False)
    settled = sup[:, 0] != -2
    assert bool(settled[4:].all()), sup[:, 0]  # the ordinary rows
    fast_tau, fast_sup = tau.clone(), sup.clone()
    finish()  # the exact kernel over the rows left
    assert torch.equal(tau[settled], fast_tau[settled]) and torch.equal(sup[settled], fast_sup[settled])
    _check_thresholds(x, t, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"), tau, sup)


@KERNEL_PATH
@ONE_PASS
def test_filter_list_cut_to_the_final_bound(one_pass, settings_override):
    """Rows of several segments of the one-pass filter (V 300 against 32 lanes, a first bound
    from 64 elements): the early, lower bounds list ids the final bound cuts, so the list is cut
    before tau is found in it; thresholds and lists are the rule's and every row is settled by
    the fast route, with each form of the filter (the one-pass form's first bound is checked
    below the final one here, so the cut does happen)."""
    from torch_fused.ops.sampler import threshold_launches

    _filter_form(settings_override, one_pass)
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(5, 300, generator=g) * 2).to(torch.bfloat16)
    for kw in (dict(top_k=5), dict(min_p=0.3), dict(top_k=4, top_p=0.8)):
        tau, sup, finish = threshold_launches(x, None, 1.0, False, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"),
                                              finish=False)
        assert bool((sup[:, 0] >= 0).all()), (kw, sup[:, 0])
        finish()
        _check_thresholds(x, 1.0, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"), tau, sup)
        # the first 64 elements alone bound each row's tau lower than the whole row does
        first = x[:, :64].float()
        if "top_k" in kw:
            early = first.view(5, 2, 32).amax(1).topk(kw["top_k"], -1).values[:, -1]
            whole = x.float().view(5, -1)
            assert bool((early < whole.topk(kw["top_k"], -1).values[:, -1]).any())
        else:
            assert bool((first.amax(-1) < x.float().amax(-1)).any())


@KERNEL_PATH
@ONE_PASS
def test_filter_forms_on_hard_rows_in_every_launch_pair(one_pass, settings_override):
    """Hard rows in each launch pair of the split forms (4 rows a pair at the small tiles) and in
    every program's later rows: ties at the top past the list (top-k: the exact kernel takes the
    row, count -2 from the fast route), a row holding a NaN (not listed), ties at the k-th value;
    every form gives the default form's thresholds and lists bitwise and the rule's thresholds on
    the rows without a NaN."""
    from torch_fused.ops.sampler import threshold_launches

    g = torch.Generator().manual_seed(31)
    x = torch.randn(11, 300, generator=g) * 2
    for r in (1, 6, 9):  # 80 ties at the top: a list of 64 overflows for top-k
        x[r, torch.randperm(300, generator=g)[:80]] = 9.0
    x[[2, 7, 10], [5, 100, 299]] = float("nan")
    x[8, torch.randperm(300, generator=g)[:6]] = x[8].max() - 0.5  # ties at the 3rd..8th largest
    x = x.to(torch.bfloat16)
    fine = torch.isfinite(x.float()).all(-1)
    for kw in (dict(top_k=3), dict(min_p=0.2), dict(top_k=4, top_p=0.8)):
        args = (x, None, 1.0, False, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
        settings_override(sampler_filter_one_pass=False, sampler_filter_split=False)
        want = threshold_launches(*args)
        _filter_form(settings_override, one_pass)
        tau, sup, finish = threshold_launches(*args, finish=False)
        if "top_k" in kw:
            assert sup[[1, 6, 9], 0].tolist() == [-2, -2, -2], (kw, sup[:, 0])
        assert sup[[2, 7, 10], 0].tolist() == [-1, -1, -1], (kw, sup[:, 0])
        finish()
        assert torch.equal(tau, want[0]) and torch.equal(sup, want[1]), (kw, torch.nonzero(tau != want[0]))
        _check_thresholds(x[fine], 1.0, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"), tau[fine], sup[fine])


@KERNEL_PATH
@TOP_P_APPEND
def test_top_p_band_settles_the_ordinary_rows(append, settings_override):
    """top-p alone at a moderate V with the real tiles (a sample of every 8th id): the sampled
    band holds the cut of the ordinary rows, whose support holds hundreds of ids (a sample's own
    mass above a value swings with the few largest ids it holds or misses: the cut is estimated
    from its mass below); the thresholds equal the rule's."""
    from torch_fused.ops.sampler import threshold_launches

    settings_override(small_tiles=False, sampler_top_p_append=append)
    x = _rows_with_hard_cases(16, 4096, torch.bfloat16, "cpu", seed=11)
    tau, sup, finish = threshold_launches(x, None, 1.0, False, None, 0.9, None, finish=False)
    assert int((sup[4:, 0] == -2).sum()) <= 1, sup[:, 0]
    finish()
    _check_thresholds(x, 1.0, None, 0.9, None, tau, sup)


@KERNEL_PATH
@TOP_P_APPEND
def test_top_p_band_crowded_past_its_list(append, settings_override):
    """top-p alone on rows whose cut falls among hundreds of nearly equal logits (ten large
    ones carry most of the mass, the rest lie within 0.25): the band around the estimated cut
    holds more than the list (64 at the small tiles), so the fast route leaves such a row to the
    exact kernel (count -2) rather than cut it from a partial list; every threshold is the rule's,
    with the band listed in order and appended."""
    from torch_fused.ops.sampler import threshold_launches

    settings_override(sampler_top_p_append=append)
    g = torch.Generator().manual_seed(5)
    x = torch.rand(4, 300, generator=g) * 0.25
    for r in range(4):
        big = torch.randperm(300, generator=g)[:10]
        x[r, big] = 5.0 + torch.rand(10, generator=g)
    x = x.to(torch.bfloat16)
    tau, sup, finish = threshold_launches(x, None, 1.0, False, None, 0.9, None, finish=False)
    assert bool((sup[:, 0] == -2).any()), sup[:, 0]
    finish()
    _check_thresholds(x, 1.0, None, 0.9, None, tau, sup)


@KERNEL_PATH
@TOP_P_APPEND
def test_top_p_next_to_one_gives_no_nan_threshold(append, settings_override):
    """top_p within an ulp of 1 in fp32 (the cut's target equals the row's whole mass up to the
    order of a sum): every route gives a real threshold that keeps at least the rule's support
    (a search that comes back empty would decode as NaN and keep no id)."""
    from torch_fused import reference
    from torch_fused.meta import sampler as meta
    from torch_fused.ops.sampler import threshold_launches

    settings_override(small_tiles=False, sampler_top_p_append=append)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(6, 300, generator=g, dtype=torch.float64) * 2).to(dtype)
        for tp in (0.9999999, 1 - 1e-9):
            for kw in (dict(top_p=tp), dict(top_k=50, top_p=tp)):
                tau, _ = threshold_launches(x, None, 1.0, False, kw.get("top_k"), tp, None)
                want = reference.sampler_threshold(x, None, meta.sampler_options(1.0, False, kw.get("top_k"), tp, None))
                assert not bool(torch.isnan(tau).any()), (dtype, kw, tau)
                assert bool((tau <= want.to(tau.dtype)).all()), (dtype, kw, tau, want)


@KERNEL_PATH
def test_exact_threshold_kernel_alone_matches_the_rule(settings_override):
    """The exact kernel on every row (the sampler_exact setting): min-p, top-k and top-p at once,
    fp16 logits (keys on a grid of 2^13)."""
    x = _rows_with_hard_cases(5, 32, torch.float16, "cpu", seed=8)
    settings_override(sampler_exact=True)
    tau, sup = torch.ops.fused._sampler_threshold(x, None, 1.3, False, 4, 0.7, 0.01)
    assert bool((sup[:, 0] == -1).all())
    _check_thresholds(x, 1.3, 4, 0.7, 0.01, tau, sup)


@pytest.mark.parametrize("device", DEVICES)
def test_listed_and_streamed_backward_agree(device):
    """A listed row's forward (its statistics summed over the listed logits alone) equals the
    streamed row's (the whole row read with the threshold) to fp32 rounding, and its backward
    (zeros, then the listed columns) the streamed backward bitwise from the same statistics; an
    id outside the support passes no gradient either way (K ids, the entropy, a tensor
    temperature)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 100, generator=g) * 3).to(device).requires_grad_(True)  # 3 segments in the interpreter run
    idx = torch.randint(0, 100, (3, 3), generator=g).to(device)
    t = torch.tensor(0.9, device=device)
    tau, sup = torch.ops.fused._sampler_threshold(x.detach(), t, 1.0, False, 6, None, None)
    listed = sup.clone()
    if device == "cpu" and not INTERPRET:  # the reference lists nothing: list the rows here
        for r in range(3):
            kept = torch.nonzero(x[r] >= tau[r])[:, 0]
            listed[r, 0] = len(kept)
            listed[r, 1:1 + len(kept)] = kept.int()
    assert bool((listed[:, 0] >= 0).all())
    gl = torch.randn(3, 3, generator=g).to(device)
    ge = torch.randn(3, generator=g).to(device)
    grads, outs = [], []
    for s in (listed, None):
        lp, ent, stats = torch.ops.fused._logprobs_entropy_forward(x, idx, t, 1.0, -100, True, False, tau, s)
        # the upstream gradient reaches the ids outside the support too: the core passes it on
        # to no logit (neither the id's own nor the kept ones' through G)
        (dx,) = torch.autograd.grad((lp, ent), x, (gl, ge), retain_graph=True)
        grads.append(dx)
        outs.append((lp, ent, stats))
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    # the backward from one forward's statistics: listed and streamed rows bitwise equal
    _, ent0, stats0 = (o.detach() for o in outs[0])
    dxs = [torch.ops.fused._logprobs_entropy_backward(gl, ge, x.detach(), idx, stats0, ent0, t, 1.0, -100, True,
                                                        False, tau, s)[0] for s in (listed, None)]
    assert torch.equal(dxs[0], dxs[1])
    assert torch.equal(dxs[0], grads[0])
    outside = x.detach().gather(1, idx) < tau[:, None]
    assert bool(outside.any()) and bool((~outside).any())
    kept = x.detach() >= tau[:, None]
    assert bool((grads[0][~kept] == 0).all())
    # within the support: the gradient of the kept ids' log-probs alone
    lp, ent, _ = outs[0]
    want = torch.autograd.grad((torch.where(outside, 0.0, lp) * gl).sum() + (ent * ge).sum(), x)[0]
    torch.testing.assert_close(grads[0], want, rtol=0, atol=0)


@ONE_PASS
@pytest.mark.parametrize("device", ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.cuda)])
def test_filter_list_at_its_capacity(device, one_pass, settings_override):
    """The filter kernel's working list at its capacity: a row with exactly cap ids at or above
    its bound keeps them all (listed where the support list holds them), one with cap + 1 is
    not listed (min-p alone: its threshold is exact without the list), and both thresholds and
    log-probs are the rule's. One pass: the first row's list overflows on the early bounds and
    is listed again."""
    from torch_fused.kernels import sampler as KS
    from torch_fused.meta import sampler as meta
    from torch_fused.settings import current

    _filter_form(settings_override, one_pass)

    v = 300
    cap = KS.config(2, v, current.small_tiles).cap
    if cap + 1 > v:
        pytest.skip("the list holds a whole row at this vocabulary")
    x = torch.full((2, v), -10.0)
    x[0, torch.randperm(v, generator=torch.Generator().manual_seed(2))[:cap]] = 0.0  # cap ties at the max
    x[1, torch.randperm(v, generator=torch.Generator().manual_seed(3))[:cap + 1]] = 0.0
    x = x.to(torch.bfloat16).to(device)
    tau, sup = torch.ops.fused._sampler_threshold(x, None, 1.0, False, None, None, 0.5)
    want = torch_fused.reference.sampler_threshold(x, None, meta.sampler_options(1.0, False, None, None, 0.5))
    assert torch.equal(tau, want)
    listed = cap <= meta.SUPPORT_CAP
    assert sup[:, 0].tolist() == [cap if listed else -1, -1]
    if listed:
        assert torch.equal(sup[0, 1:1 + cap].cpu(), torch.nonzero(x[0].cpu() == 0.0)[:, 0].int())
    idx = torch.stack([x[0].float().argmax(), x[1].float().argmax()])
    lp = torch_fused.selective_log_softmax(x, idx, min_p=0.5)
    want_lp = -torch.tensor([cap, cap + 1], dtype=torch.float64).log().float()
    torch.testing.assert_close(lp.cpu(), want_lp, rtol=0, atol=2e-6)


@ONE_PASS
@pytest.mark.parametrize("device", ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_row_holding_a_nan_is_not_listed(device, one_pass, settings_override):
    """The kernels' support lists leave out a row holding a NaN logit (no list holds the NaN, and
    the forward sums a listed row's listed logits alone): the log-prob ops read that row whole,
    and its in-support log-probs are NaN, as without the kernels; the other rows are listed and
    finite."""
    _filter_form(settings_override, one_pass)
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 64, generator=g) * 3).to(device)
    x[1, 10] = float("nan")
    idx = x.nan_to_num(float("-inf")).argmax(-1)  # each row's largest finite logit: in its support
    for kw in (dict(top_k=5), dict(min_p=0.05), dict(top_k=5, top_p=0.9)):
        _, sup = torch.ops.fused._sampler_threshold(x, None, 1.0, False, kw.get("top_k"), kw.get("top_p"),
                                                    kw.get("min_p"))
        assert sup[:, 0].tolist()[1] == -1 and min(sup[[0, 2], 0].tolist()) >= 1, (kw, sup[:, 0])
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, **kw)
        assert bool(torch.isnan(lp[1])) and bool(torch.isnan(ent[1])), kw
        assert bool(torch.isfinite(lp[[0, 2]]).all()) and bool(torch.isfinite(ent[[0, 2]]).all()), kw


@pytest.mark.parametrize("args,msg", [
    (lambda x: (torch.zeros(3), None), r"threshold: expected torch.float32 of shape \(2,\) \(one per row\)"),
    (lambda x: (torch.zeros(2), torch.zeros(2, 5, dtype=torch.int32)), r"support: expected int32 of shape \(2, 513\)"),
    (lambda x: (None, torch.zeros(2, 513, dtype=torch.int32)), r"support: expected int32 .* without one"),
], ids=["threshold shape", "support shape", "support alone"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.skipif(INTERPRET, reason="the checks run before any kernel: the plain CPU run covers them")
def test_bad_threshold_or_support_names_it(args, msg, mode):
    x = torch.randn(2, 9)
    tau, sup = args(x)

    def f(x):
        return torch.ops.fused._logprobs_entropy_forward(x, None, None, 1.0, -100, True, False, tau, sup)[1]

    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=msg):
        f(x)


@pytest.mark.skipif(INTERPRET, reason="opcheck of the thresholds' op: the plain CPU run (the kernels: the tests above)")
def test_threshold_op_opcheck():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 30, generator=g)
    for args in [(None, 1.0, True, 5, None, None), (torch.tensor(0.8), 1.0, False, None, 0.9, 0.05)]:
        torch.library.opcheck(torch.ops.fused._sampler_threshold, (x,) + args)
    tau, sup = torch.ops.fused._sampler_threshold(x, None, 1.0, True, 5, None, None)
    torch.library.opcheck(torch.ops.fused._logprobs_entropy_forward,
                          (x.requires_grad_(True), torch.randint(0, 30, (2, 3)), None, 1.0, -100, True, True, tau, sup))


# ---------------------------------------------------------------------------------------------
# CUDA: the benchmark's vocabularies, memory
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("v", [151936, 32000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_threshold_kernels_at_vocabulary_size(v, dtype):
    """Every route at a real vocabulary: the fast routes settle nearly every ordinary row, and the
    thresholds equal the rule's (top-p rows whose cut lies within fp32 rounding of top_p apart)."""
    from torch_fused.ops.sampler import threshold_launches

    x = _rows_with_hard_cases(64, v, dtype, "cuda", seed=11)
    for t, kw in [(1.0, dict(min_p=0.05)), (1.0, dict(top_k=50)), (0.8, dict(top_k=256)), (1.0, dict(top_p=0.9)),
                  (0.7, dict(top_p=0.5, min_p=0.01)), (1.0, dict(top_k=50, top_p=0.9)), (1.0, dict(top_k=3000))]:
        args = (x, None, t, False, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
        tau, sup, finish = threshold_launches(*args, finish=False)
        assert int((sup[4:, 0] == -2).sum()) <= 2, (kw, sup[:, 0])
        finish()
        clear = _check_thresholds(x, t, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"), tau, sup)
        if set(kw) == {"top_p"} and v > 100000:
            # at V 151936 the ids around a randn row's cut each hold about 1e-5 of its mass, so no
            # row is clear of fp32 rounding there: each ordinary row's cut is checked against the
            # float64 masses instead
            valid = _top_p_cut_is_valid(x[4:], t, kw["top_p"], tau[4:])
            assert bool(valid.all()), (kw, torch.nonzero(~valid))
        else:
            assert int(clear.sum()) >= 40, kw


@pytest.mark.cuda
@pytest.mark.parametrize("v", [151936, 32000])
@pytest.mark.parametrize("form", [(True, False), (False, True), (True, True)],
                         ids=["one-pass", "two-pass-split", "one-pass-split"])
def test_filter_forms_agree_at_vocabulary_size(v, form, settings_override, monkeypatch):
    """The filter's other forms give the default form's thresholds and support lists bitwise at
    a real vocabulary (the split forms in launch pairs of 16 rows, so that hard rows sit in
    later pairs too); the top-p kernel's appending band pass gives the rule's thresholds."""
    from torch_fused.kernels import sampler as KS
    from torch_fused.ops.sampler import threshold_launches

    base = KS.config
    monkeypatch.setattr(KS, "config", lambda e, vv, small: base(e, vv, small)._replace(split_rows=16))
    x = _rows_with_hard_cases(64, v, torch.bfloat16, "cuda", seed=12)
    x[40:44] = x[:4]  # the hard rows again, in a later launch pair
    x[45, 7] = float("nan")
    for t, kw in [(1.0, dict(min_p=0.05)), (1.0, dict(top_k=50)), (0.8, dict(top_k=256)),
                  (1.0, dict(top_k=50, top_p=0.9)), (0.7, dict(top_k=3, min_p=0.01))]:
        args = (x, None, t, False, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
        settings_override(sampler_filter_one_pass=False, sampler_filter_split=False)
        want = threshold_launches(*args)
        _filter_form(settings_override, form)
        got = threshold_launches(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (kw, torch.nonzero(got[0] != want[0]))
    settings_override(sampler_top_p_append=True)
    keep = torch.ones(64, dtype=torch.bool)
    keep[45] = False  # (a NaN row's cut is the kernels' own)
    tau, sup = threshold_launches(x[keep], None, 1.0, False, None, 0.9, None)
    clear = _check_thresholds(x[keep], 1.0, None, 0.9, None, tau, sup)
    if v > 100000:  # (see test_threshold_kernels_at_vocabulary_size)
        assert bool(_top_p_cut_is_valid(x[keep][4:], 1.0, 0.9, tau[4:]).all())
    else:
        assert int(clear.sum()) >= 40


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [dict(top_k=50), dict(min_p=0.05), dict(top_p=0.9)], ids=str)
def test_restricted_ops_keep_no_logits_sized_buffer(kw):
    """The restricted forward+backward holds O(rows) more memory than the unrestricted one: no
    masked copy of the logits, no sort."""
    x = (torch.randn(256, 151936, device="cuda") * 3).to(torch.bfloat16).requires_grad_(True)
    idx = torch.randint(0, 151936, (256,), device="cuda")

    def peak(**k):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = torch_fused.selective_log_softmax(x, idx, **k)
        (dx,) = torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum(), x)
        del dx, lp
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    from torch_fused._library import n_sm
    from torch_fused.kernels import sampler as KS
    from torch_fused.meta.logprobs import SUPPORT_CAP

    peak(**kw)
    extra = peak(**kw) - peak()
    # per row its threshold and support list, and the kernels' working lists: a fixed number of
    # programs (at most one per row) with cap_p entries of 8 bytes each; a masked copy would be 78 MB
    cfg = KS.config(2, 151936, False)
    scratch = min(256, n_sm(x.device) * KS.PROGRAMS_PER_SM) * cfg.cap_p * 8
    assert extra <= 256 * (SUPPORT_CAP + 2) * 4 + scratch + (4 << 20), extra


@pytest.mark.parametrize("device", DEVICES)
def test_rule_thresholds_do_not_depend_on_its_chunks(device, settings_override):
    """The plain-PyTorch rule (sampler_kernels off) works in chunks of rows sized per device type
    (sampler_rule_chunk_bytes): one row a chunk and the whole batch in one chunk give the same
    thresholds, for each option and with a tensor temperature."""
    from torch_fused import reference
    from torch_fused.meta import sampler as meta

    v = 300
    x = _rows_with_hard_cases(24, v, torch.bfloat16, device, seed=5)
    temp = torch.tensor(0.8, device=device)
    for kw in (dict(top_k=7), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=40, top_p=0.6, min_p=0.01)):
        opts = meta.sampler_options(1.0, False, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
        taus = []
        for rows in (1, 5, 24):
            settings_override(sampler_rule_chunk_bytes={device: 4 * v * rows}, reference_chunk_elems=v * rows)
            taus.append(reference.sampler_threshold(x, temp, opts))
        for t in taus[1:]:
            assert torch.equal(t, taus[0]), kw
    # shifted rows of [B, L+1, V] (not one strided run): the same thresholds as the contiguous
    # copy's, from chunks that are views of the logits (no copy of the whole batch)
    x3 = x.reshape(4, 6, v)
    opts = meta.sampler_options(1.0, True, 7, 0.9, None)
    want = reference.sampler_threshold(x3[:, :-1].contiguous(), temp, meta.sampler_options(1.0, False, 7, 0.9, None))
    for rows in (1, 4, 24):
        settings_override(sampler_rule_chunk_bytes={device: 4 * v * rows}, reference_chunk_elems=v * rows)
        assert torch.equal(reference.sampler_threshold(x3, temp, opts), want), rows
    chunks = list(reference._row_chunks(x3[:, :-1], 3))
    assert [(a, b) for a, b, _ in chunks] == [(0, 3), (3, 5), (5, 8), (8, 10), (10, 13), (13, 15), (15, 18), (18, 20)]
    assert all(c._base is not None and torch.equal(c, x3[:, :-1].reshape(-1, v)[a:b]) for a, b, c in chunks)


@pytest.mark.parametrize("device", ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.cuda)])
def test_sampler_kernels_setting_switches_the_route_not_the_result(device, settings_override):
    """sampler_kernels off: the thresholds come from the plain-PyTorch rule on the device (no row
    listed); on: from the Triton kernels (short supports listed). The same thresholds and the same
    log-probs either way."""
    gen = torch.Generator().manual_seed(31)
    x = (torch.randn(6, 300, generator=gen) * 3).to(torch.bfloat16).to(device)
    idx = torch.randint(0, 300, (6,), generator=gen).to(device)
    out = {}
    for on in (False, True):
        settings_override(sampler_kernels=on)
        tau, sup = torch.ops.fused._sampler_threshold(x, None, 0.9, False, 7, None, None)
        lp = torch_fused.selective_log_softmax(x, idx, temperature=0.9, top_k=7)
        out[on] = (tau, sup, lp)
    assert bool((out[False][1][:, 0] == -1).all())  # the reference lists no row
    assert bool((out[True][1][:, 0] >= 7).all())  # the kernels list each row's (>= 7) kept ids
    assert torch.equal(out[False][0], out[True][0])
    torch.testing.assert_close(out[False][2], out[True][2], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The fused lm_head over the sampler's support (token-row chunks of whole logits rows): against the
# logits ops on the float64 logits of the same inputs (the rule itself is tested above)
# ---------------------------------------------------------------------------------------------
def _head_inputs(device, n, hd, v, seed, k=None, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hd, generator=g) * 0.6
    w = torch.randn(v, hd, generator=g) * 0.6
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    # ids drawn from each row's top logits (inside the support) and uniformly (mostly outside)
    z = h.double() @ w.double().T
    top = z.topk(4, -1).indices
    shape = (n,) if k is None else (n, k)
    idx = torch.randint(0, v, shape, generator=g)
    pick = torch.randint(0, 4, shape, generator=g)
    inside = torch.rand(shape, generator=g) < 0.7
    idx = torch.where(inside, top.gather(-1, pick.reshape(n, -1)).reshape(shape), idx)
    idx.view(-1)[1] = -100
    return h.to(device), w.to(device), None if b is None else b.to(device), idx.to(device)


def _head_logits64(h, w, b, logit_scale=1.0, softcap=None):
    z = torch.nn.functional.linear(h, w, b)
    return softcap * torch.tanh(logit_scale * z / softcap) if softcap is not None else z * logit_scale


HEAD_SUPPORT_CASES = [
    (dict(top_k=5), dict()),
    (dict(top_p=0.7), dict(softcap=2.0, logit_scale=0.8, temperature=1.3)),
    (dict(top_k=20, top_p=0.9, min_p=0.02), dict(logit_scale=1.5, temperature=0.8, shift=True)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw,extra", HEAD_SUPPORT_CASES[:1] if INTERPRET else HEAD_SUPPORT_CASES, ids=str)
@pytest.mark.parametrize("k", [3] if INTERPRET else [None, 3])
def test_fused_head_over_the_support_matches_the_logits_ops(device, kw, extra, k, settings_override):
    """Log-probs, entropy and the gradients of hidden, weight and bias: the head (fp32 inputs,
    several token-row chunks) against logprobs_and_entropy on the float64 logits. Ids outside the
    support: -inf at the same positions, no gradient."""
    n, hd, v = (9, 8, 70) if INTERPRET else (23, 16, 300)
    settings_override(lm_head_support_chunk_bytes={"cpu": 4 * v * 4, "cuda": 4 * v * 4})  # 4 rows a chunk
    shift = extra.get("shift", False)
    h, w, b, idx = _head_inputs(device, n, hd, v, seed=5 + (k or 0), k=k)
    if shift:  # [2, L+1, H] hidden states scoring [2, L] ids
        h, idx = h[: 2 * (n // 2)].reshape(2, n // 2, hd), idx[: 2 * (n // 2) - 2].reshape(2, n // 2 - 1, *idx.shape[1:])
    opts = {key: val for key, val in extra.items() if key != "shift"}
    hf, wf, bf = (t.clone().requires_grad_(True) for t in (h, w, b))
    lp, ent = torch_fused.linear_logprobs_and_entropy(hf, wf, idx, bias=bf, shift=shift, **opts, **kw)
    h64, w64, b64 = (t.detach().double().cpu().requires_grad_(True) for t in (h, w, b))
    z = _head_logits64(h64, w64, b64, opts.get("logit_scale", 1.0), opts.get("softcap"))
    lr, er = torch_fused.logprobs_and_entropy(z, idx.cpu(), temperature=opts.get("temperature", 1.0), shift=shift, **kw)
    finite = torch.isfinite(lr)
    assert torch.equal(torch.isfinite(lp).cpu(), finite)
    assert bool((lp.cpu()[~finite] == NINF).all()) and bool(finite.any()) and bool((~finite).any())
    torch.testing.assert_close(lp.double().cpu()[finite], lr[finite], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double().cpu(), er, rtol=0, atol=2e-5)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(lr.shape, generator=g, dtype=torch.float64), torch.randn(er.shape, generator=g,
                                                                                          dtype=torch.float64)
    got = torch.autograd.grad((torch.where(torch.isfinite(lp), lp, 0.0) * g_lp.to(device).float()).sum()
                              + (ent * g_ent.to(device).float()).sum(), (hf, wf, bf))
    want = torch.autograd.grad((torch.where(finite, lr, 0.0) * g_lp).sum() + (er * g_ent).sum(), (h64, w64, b64))
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(a.double().cpu(), e, rtol=1e-4, atol=2e-5, msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernels", [True, False], ids=["sampler_kernels", "no_sampler_kernels"])
@pytest.mark.parametrize("ties,dtype", [(False, torch.bfloat16), (True, torch.float32)] if INTERPRET else
                         [(t, d) for t in (False, True) for d in (torch.float32, torch.bfloat16)])
def test_fused_head_listed_and_chunked_backward_agree(device, kernels, ties, dtype, settings_override):
    """With top_k <= 512 the backward runs from the forward's list of kept ids (no GEMM); off
    (lm_head_support_listed), from recomputed logits: the same gradients. ``ties``: a weight row
    repeated so that ids tie at the k-th logit of row 0, more kept than k: that row is not listed
    and takes the chunked backward with the setting on too. ignore_index is a real id (row 2's
    first), which no route may pass a gradient through. ``kernels``: the list from the threshold
    kernels (on the Triton path) or from a top-k of each row; a row listed by both is listed
    alike (count, ids, logits)."""
    if INTERPRET and not kernels and not ties:
        pytest.skip("the top-k route under the interpreter: the case with ties (the plain CPU run takes both)")
    settings_override(sampler_kernels=kernels)
    n, hd, v = (6, 8, 40) if INTERPRET else (17, 16, 200)
    h, w, b, idx = _head_inputs(device, n, hd, v, seed=9, k=2)
    ignore = int(idx[2, 0])
    idx = torch.where(idx == -100, ignore, idx)
    if ties:  # row 0's 3rd largest logit, repeated in 3 more vocabulary rows
        z = h[0].double().cpu() @ w.double().cpu().T + b.double().cpu()
        third = int(z.topk(3).indices[-1])
        spare = [j for j in z.argsort().tolist() if j != third][:3]
        w[spare], b[spare] = w[third].clone(), b[third].clone()
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    grads = []
    for listed in (True, False):
        settings_override(lm_head_support_listed=listed)
        hf, wf, bf = (t.clone().requires_grad_(True) for t in (h, w, b))
        lp, ent = torch_fused.linear_logprobs_and_entropy(hf, wf, idx, bias=bf, top_k=3, temperature=0.9,
                                                          ignore_index=ignore)
        assert bool((lp[idx == ignore] == 0).all())
        g = torch.autograd.grad((torch.where(torch.isfinite(lp), lp, 0.0) * torch.linspace(-1, 2, lp.numel(), device=device)
                                 .reshape(lp.shape)).sum() + (ent * 0.7).sum(), (hf, wf, bf))
        grads.append(g)
    stats = torch.ops.fused._linear_logprobs_entropy_forward(h, w, idx, b, 0.9, ignore, False, 1.0, None, 3, None,
                                                             None)[2]
    assert stats.shape == (n, 4 + 2 * 3)
    # without ties every row listed; with them row 0 (and any row the repeated weight rows tie) not,
    # the others listed: one call through both routes
    assert bool((stats[0, 3] < 0) == ties) and bool((stats[1:, 3] == 3).all() if not ties else (stats[:, 3] == 3).any())
    with torch_fused.settings.override(sampler_kernels=not kernels):
        other = torch.ops.fused._linear_logprobs_entropy_forward(h, w, idx, b, 0.9, ignore, False, 1.0, None, 3, None,
                                                                 None)[2]
    both = (stats[:, 3] > 0) & (other[:, 3] > 0)
    assert bool(both.any())
    torch.testing.assert_close(stats[both, 3:], other[both, 3:], rtol=0, atol=0)
    # bf16: both routes round d logits to bf16 once, from fp32 values of different formulas
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for name, a, e in zip(("hidden", "weight", "bias"), *grads):
        torch.testing.assert_close(a.float(), e.float(), **tol, msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernels", [True, False], ids=["sampler_kernels", "no_sampler_kernels"])
@pytest.mark.parametrize("kw,scale,dtype", [(dict(top_k=4), 1.0, torch.float32),
                                             (dict(top_k=4, min_p=0.3), 1.0, torch.float32),
                                             (dict(top_k=4, min_p=0.3), 2.0, torch.float32),
                                             (dict(top_k=4, min_p=0.6), 0.5, torch.float64),
                                             (dict(top_k=60), 1.0, torch.float32)], ids=str)
def test_fused_head_min_p_top_k_threshold_is_the_rules(device, kernels, kw, scale, dtype, settings_override):
    """With min-p / top-k (no top-p) the support path's threshold is the rule's
    (reference.sampler_threshold) on the same logits at the head's temperature (T / logit_scale),
    with ties past the k-th value, top_k >= V, fp32 and fp64. On the Triton path with the
    threshold kernels on (fp32) it comes from them, as the logits ops' does: equal to their
    threshold on every row, the rows with a NaN or +inf logit included (which may be cut
    elsewhere than the rule cuts them, sampler_kernels' documented exception); else from the
    listing's own top k, equal to the rule on those rows too. Integer-valued inputs make every
    GEMM exact, so the logits are the rule's whatever the GEMM's blocking."""
    if INTERPRET and not kernels and (kw, scale) != (dict(top_k=4, min_p=0.3), 2.0):
        pytest.skip("the top-k route under the interpreter: one option set (the plain CPU run takes it for all)")
    settings_override(sampler_kernels=kernels)
    from torch_fused import reference
    from torch_fused.meta.sampler import sampler_options
    g = torch.Generator().manual_seed(3)
    n, hd, v = 12, 6, 50
    h = torch.randint(-2, 3, (n, hd), generator=g).to(dtype)
    w = torch.randint(-2, 3, (v, hd), generator=g).to(dtype)
    h[5] = float("nan")  # row 5: every logit NaN
    # row 6: one NaN logit (id 7: inf * 0), the others +-inf
    w[:, 0] = torch.where(w[:, 0] == 0, 1.0, w[:, 0])
    w[7, 0], h[6, 0] = 0.0, float("inf")
    idx = torch.randint(0, v, (n,), generator=g)
    stats = torch.ops.fused._linear_logprobs_entropy_forward(h.to(device), w.to(device), idx.to(device), None, 0.7,
                                                             -100, False, scale, None, kw["top_k"], None,
                                                             kw.get("min_p"))[2]
    z = h @ w.T
    assert bool(torch.isnan(z[6]).sum() == 1) and bool(torch.isinf(z[6]).sum() == v - 1) and bool(torch.isnan(z[5]).all())
    rule = reference.sampler_threshold(z, None, sampler_options(0.7 / scale, False, kw["top_k"], None, kw.get("min_p")))
    finite = torch.ones(n, dtype=torch.bool)
    finite[5:7] = False
    torch.testing.assert_close(stats[finite, 2].cpu(), rule[finite], rtol=0, atol=0)
    want = rule
    if kernels and (INTERPRET or device == "cuda") and dtype != torch.float64:
        want = torch.ops.fused._sampler_threshold(z.to(device), None, 0.7 / scale, False, kw["top_k"], None,
                                                  kw.get("min_p"))[0].cpu()
    torch.testing.assert_close(stats[:, 2].cpu(), want, rtol=0, atol=0, equal_nan=True)
    applies = kw["top_k"] < v or "min_p" in kw  # top_k >= V alone keeps every id: -inf, NaN row or not
    assert bool(torch.isnan(rule[5])) == applies and bool(torch.isfinite(rule[:5]).all()) == applies


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.skipif(INTERPRET, reason="the checks run before any kernel: the plain CPU run covers them")
def test_fused_head_bad_sampler_option_names_it(mode):
    h, w, idx = torch.randn(3, 4), torch.randn(9, 4), torch.randint(0, 9, (3,))

    def fn(h, w, idx):
        return torch_fused.linear_logprobs_and_entropy(h, w, idx, top_p=1.5)

    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError if mode == "eager" else Exception, match=r"top_p: expected None or a number in \(0, 1\]"):
        fn(h, w, idx)
    with pytest.raises(ValueError, match="top_k: expected None or an int >= 1"):
        torch.ops.fused.linear_logprobs_and_entropy(h, w, idx, top_k=0)


@pytest.mark.skipif(INTERPRET, reason="the op's registration and tracing: the plain CPU run covers it")
def test_fused_head_over_the_support_opcheck_and_compiled_without_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    w = torch.randn(40, 8, generator=g, requires_grad=True)
    idx = torch.randint(0, 40, (2, 5), generator=g)
    for op, args in ((torch.ops.fused.linear_logprobs_and_entropy, (h, w, idx)),
                     (torch.ops.fused._linear_logprobs_entropy_forward,
                      (h, w, idx, None, 1.0, -100, True, 1.0, None, 7, 0.8, None))):
        torch.library.opcheck(op, args, dict(shift=True, top_k=7, top_p=0.8) if len(args) == 3 else {})

    def loss(h, w, idx):
        lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, shift=True, top_k=7, top_p=0.8)
        return torch.where(torch.isfinite(lp), lp, 0.0).sum() + ent.sum()

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    step = torch.compile(loss, backend=cnt, fullgraph=True, dynamic=True)
    frames = []
    for length in (5, 8, 11):
        hl = torch.randn(2, length + 1, 8, generator=g, requires_grad=True)
        il = torch.randint(0, 40, (2, length), generator=g)
        got = step(hl, w, il)
        dh, dw = torch.autograd.grad(got, (hl, w))
        want = loss(hl, w, il)
        wdh, wdw = torch.autograd.grad(want, (hl, w))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(dh, wdh)
        torch.testing.assert_close(dw, wdw)
        frames.append(cnt.frame_count)
    # (the first call may trace twice: Dynamo restarts once to specialize the float defaults)
    assert frames[0] == frames[-1], f"recompiled across sequence lengths: frames {frames}"


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [dict(top_k=50), dict(top_p=0.9), dict(min_p=0.05)], ids=str)
def test_fused_head_over_the_support_at_vocabulary_size(kw):
    """bf16 hidden states and weight at (N 1024, H 1024, V 151936), several token-row chunks:
    log-probs and entropy within 1e-4 of the logits ops on the fp32 logits of the same inputs,
    the same ids outside the support, and d hidden close to theirs."""
    g = torch.Generator().manual_seed(7)
    n, hd, v = 1024, 1024, 151936
    h = (torch.randn(n, hd, generator=g) * 0.05).to(torch.bfloat16).cuda().requires_grad_(True)
    w = (torch.randn(v, hd, generator=g) * 0.05).to(torch.bfloat16).cuda()
    z32 = h.detach().float() @ w.float().T
    idx = torch.where(torch.rand(n, device="cuda") < 0.8, z32.argmax(-1),
                      torch.randint(0, v, (n,), device="cuda"))
    lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, **kw)
    x = z32.clone().requires_grad_(True)
    lr, er = torch_fused.logprobs_and_entropy(x, idx, **kw)
    assert torch.equal(torch.isfinite(lp), torch.isfinite(lr))
    fin = torch.isfinite(lr)
    torch.testing.assert_close(lp[fin], lr[fin], rtol=0, atol=1e-4)
    torch.testing.assert_close(ent, er, rtol=0, atol=1e-4)
    (dh,) = torch.autograd.grad(torch.where(fin, lp, 0.0).sum() + ent.sum(), h)
    (dx,) = torch.autograd.grad(torch.where(fin, lr, 0.0).sum() + er.sum(), x)
    want = (dx.to(torch.bfloat16).float() @ w.float()).to(torch.bfloat16)
    torch.testing.assert_close(dh.float(), want.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_head_row_route_does_not_depend_on_the_batch(device, settings_override):
    """With top_k <= 512 each row takes its own backward route (its kept ids listed, or recomputed
    logits where ties run past the k-th id): rows beside an unlisted row get the same d hidden,
    bit for bit, as without it (batch invariance on)."""
    settings_override(lm_head_batch_invariant=True)
    gen = torch.Generator().manual_seed(0)
    n, hd, v = 3, 16, 64
    h, w = torch.randn(n, hd, generator=gen), torch.randn(v, hd, generator=gen)
    z = h[0].double() @ w.double().T  # row 0: its 3rd largest logit repeated in 3 more vocabulary rows
    third = int(z.topk(3).indices[-1])
    w[[j for j in z.argsort().tolist() if j != third][:3]] = w[third].clone()
    h, w = h.to(device), w.to(device)
    idx = torch.randint(0, v, (n,), generator=gen).to(device)

    def d_hidden(rows):
        hf = h[rows].clone().requires_grad_(True)
        lp, ent = torch_fused.linear_logprobs_and_entropy(hf, w, idx[rows], top_k=3)
        (g,) = torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum() + ent.sum(), hf)
        return g

    assert torch.equal(d_hidden([1, 2]), d_hidden([0, 1, 2])[1:])
