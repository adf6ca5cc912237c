"""fused::sinkgd_step (called through torch_fused.optim.sinkgd_step) and torch_fused.optim.SinkGD
against a float64 reference of the formula in docs/SINKGD.md (explicit X, no factorization).

In the interpreter run (TRITON_INTERPRET=1, tests/test_interpreter.py) the op runs the Triton
kernels, so the tests here keep their shapes small there; the optimizer's multi-step training
loops run in the plain CPU run only."""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fused  # noqa: F401
from torch_fused.optim import SinkGD, SinkGDCache, sinkgd_param_groups, sinkgd_step
from torch_fused._library import HAS_TRITON, INTERPRET
from _helpers import DEVICES, SMALL

OPS = torch.ops.fused
PLAIN_ONLY = pytest.mark.skipif(INTERPRET, reason="a multi-step training loop: the plain CPU run covers it")
NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _op_args(params, grads, **kw):
    """fused::sinkgd_step's positional arguments from keywords (for opcheck, which takes the op
    itself); unnamed ones get the optimizer's defaults."""
    vals = dict(spectral_vecs=[], lr=torch.tensor(0.1), lr_scale=0.05, weight_decay=0.0, eps=1e-8, sinkhorn_iters=5,
                spectral_norm=False, spectral_target="unit", spectral_iters=1, base_width=None, width_exponent=1.0,
                stochastic_round=False, seed=torch.tensor(0.0))
    vals.update(params=params, grads=grads, **kw)
    return tuple(vals[a.name] for a in OPS.sinkgd_step.default._schema.arguments)


def ref_sinkgd(w, g, lr, *, iters=5, lr_scale=0.05, wd=0.0, eps=1e-8, spectral=False, target="unit",
               spectral_iters=1, v=None, base_width=None, width_exponent=1.0):
    """float64, the formula of docs/SINKGD.md verbatim. Returns (new W in float64, new v; v
    itself without the spectral step)."""
    x = g.double().reshape(-1, *g.shape[-2:])
    m, n = x.shape[-2:]
    for _ in range(iters):
        x = math.sqrt(n) * x / x.norm(dim=2, keepdim=True).clamp_min(eps)
        x = math.sqrt(m) * x / x.norm(dim=1, keepdim=True).clamp_min(eps)
    if spectral:
        v = v.double().clone()
        for _ in range(spectral_iters):
            u = torch.einsum("bmn,bn->bm", x, v)
            u = u / u.norm(dim=1, keepdim=True).clamp_min(eps)
            wv = torch.einsum("bmn,bm->bn", x, u)
            sigma = wv.norm(dim=1)
            restart = torch.cos(0.5 + 2.399963 * torch.arange(n, dtype=torch.float32)).double()
            v = torch.where(sigma[:, None] > 0, wv / sigma[:, None], restart)
        tgt = 1.0 if target == "unit" else math.sqrt(m / n)
        x = x * torch.where(sigma > 0, tgt / sigma.clamp_min(eps), 0.0)[:, None, None]
    eta = lr * lr_scale * ((base_width / n) ** width_exponent if base_width else 1.0)
    w64 = w.double().reshape(x.shape)
    return (w64 - eta * (x + wd * w64)).reshape(w.shape), v


SHAPES = [(1, 7), (6, 1), (3, 5), (2, 3, 4), (17, 9), (5, 33)] + ([] if SMALL else [(64, 48), (2, 40, 70)])


@st.composite
def sg_cases(draw):
    return dict(
        shape=draw(st.sampled_from(SHAPES)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        iters=draw(st.sampled_from([0, 1, 2] if SMALL else [0, 1, 5])),  # 2: both kernel variants
        wd=draw(st.sampled_from([0.0, 0.1])),
        spectral=draw(st.sampled_from([None, "unit", "muon"])),
        spectral_iters=draw(st.sampled_from([1, 3])),
        base_width=draw(st.sampled_from([None, 16.0])),
        width_exponent=draw(st.sampled_from([1.0, 0.5])),
        lr=draw(st.sampled_from([0.1, 1.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def _ulp(dtype):
    """The update is computed in fp32 and stored once in the parameter's dtype."""
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    if INTERPRET and dtype == torch.bfloat16:
        # Triton's interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest):
        # one whole bf16 step there. test_interpreter_bf16_cast_truncates
        ulp = 2**-7
    return ulp


def _assert_update_close(got, ref_w, w, dtype, what=""):
    delta_ref = ref_w - w.double()
    err = (got.cpu().double() - ref_w).abs()
    bound = _ulp(dtype) * ref_w.abs() + 1e-4 * delta_ref.abs().max() + 1e-30
    assert bool((err <= bound).all()), f"{what}max err {err.max().item():.3g} (bound {bound.max().item():.3g})"


@pytest.mark.parametrize("device", DEVICES)
@given(c=sg_cases())
def test_sinkgd_step_matches_float64_reference(device, c):
    gen = torch.Generator().manual_seed(c["seed"])
    shape = c["shape"]
    w = torch.randn(shape, generator=gen).to(c["dtype"])
    g = (torch.randn(shape, generator=gen) * 0.01).to(c["dtype"])
    n = shape[-1]
    b = w.numel() // (shape[-2] * n)
    v0 = torch.randn(b, n, generator=gen)
    v0 = v0 / v0.norm(dim=1, keepdim=True)
    ref_w, ref_v = ref_sinkgd(w, g, c["lr"], iters=c["iters"], wd=c["wd"], spectral=c["spectral"] is not None,
                              target=c["spectral"] or "unit", spectral_iters=c["spectral_iters"], v=v0,
                              base_width=c["base_width"], width_exponent=c["width_exponent"])
    wd_ = w.clone().to(device)  # the op updates in place; keep w for the reference
    vd = v0.clone().to(device)
    sinkgd_step([wd_], [g.to(device)], lr=c["lr"], spectral_vecs=[vd] if c["spectral"] else None,
                weight_decay=c["wd"], sinkhorn_iters=c["iters"], spectral_norm=c["spectral"] is not None,
                spectral_target=c["spectral"] or "unit", spectral_iters=c["spectral_iters"],
                base_width=c["base_width"], width_exponent=c["width_exponent"])
    _assert_update_close(wd_, ref_w, w, c["dtype"])
    if c["spectral"]:
        torch.testing.assert_close(vd.cpu().double(), ref_v, rtol=1e-4, atol=1e-5)


# Each term of the formula on its own, on a matrix of each row-pass path (in the interpreter run:
# n = 7 takes the one-read row pass, n = 70 the two-pass path), so that dropping or reordering
# one of them fails here whatever examples hypothesis draws above.
TERM_CASES = {
    "one-iteration": dict(sinkhorn_iters=1),  # rows, then columns: the order shows after one
    "weight-decay": dict(sinkhorn_iters=2, weight_decay=0.3),
    "spectral-unit": dict(sinkhorn_iters=2, spectral_norm=True, spectral_target="unit", spectral_iters=3),
    "spectral-muon": dict(sinkhorn_iters=2, spectral_norm=True, spectral_target="muon", spectral_iters=1,
                          base_width=16.0, width_exponent=0.5),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(TERM_CASES))
def test_each_term_matches_float64_formula(device, case):
    kw = TERM_CASES[case]
    gen = torch.Generator().manual_seed(7)
    shapes = [(5, 7), (3, 70)]
    ws = [torch.randn(s, generator=gen) for s in shapes]
    gs = [torch.randn(s, generator=gen) * (1 + torch.rand(s[0], 1, generator=gen) * 4) for s in shapes]
    vs = [torch.nn.functional.normalize(torch.randn(1, s[-1], generator=gen), dim=1) for s in shapes]
    got = [w.clone().to(device) for w in ws]
    got_v = [v.clone().to(device) for v in vs]
    sinkgd_step(got, [g.to(device) for g in gs], lr=0.7, spectral_vecs=got_v, **kw)
    for w, g, v, out, out_v in zip(ws, gs, vs, got, got_v):
        ref_w, ref_v = ref_sinkgd(w, g, 0.7, iters=kw["sinkhorn_iters"], wd=kw.get("weight_decay", 0.0),
                                  spectral=kw.get("spectral_norm", False), target=kw.get("spectral_target", "unit"),
                                  spectral_iters=kw.get("spectral_iters", 1), v=v,
                                  base_width=kw.get("base_width"), width_exponent=kw.get("width_exponent", 1.0))
        _assert_update_close(out, ref_w, w, torch.float32, f"{tuple(w.shape)}: ")
        if kw.get("spectral_norm"):
            torch.testing.assert_close(out_v.cpu().double(), ref_v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_gradient_leaves_weight_unchanged_plus_decay(device):
    w = torch.randn(6, 5, device=device)
    w0 = w.clone()
    sinkgd_step([w], [torch.zeros_like(w)], lr=0.5)
    assert torch.equal(w, w0)
    sinkgd_step([w], [torch.zeros_like(w)], lr=0.5, weight_decay=0.2)
    torch.testing.assert_close(w, w0 * (1 - 0.5 * 0.05 * 0.2))
    # a single zero row and column among non-zero ones: finite, and that row/column unchanged
    g = torch.randn(6, 5, device=device)
    g[2] = 0
    g[:, 3] = 0
    w1 = w.clone()
    sinkgd_step([w], [g], lr=0.5)
    assert bool(torch.isfinite(w).all())
    assert torch.equal(w[2], w1[2]) and torch.equal(w[:, 3], w1[:, 3])


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_bits(device):
    g0 = torch.Generator().manual_seed(3)
    shape, iters = ((2, 13, 11), 2) if SMALL else ((4, 37, 29), 5)
    w = torch.randn(shape, generator=g0).to(device, torch.bfloat16)
    g = torch.randn(shape, generator=g0).to(device, torch.bfloat16)
    outs = []
    for _ in range(2):
        wc = w.clone()
        v = torch.ones(shape[0], shape[-1], device=device) / math.sqrt(shape[-1])
        sinkgd_step([wc], [g], lr=0.3, spectral_vecs=[v], weight_decay=0.01, sinkhorn_iters=iters, spectral_norm=True,
                    spectral_target="muon", spectral_iters=2, stochastic_round=True, step=torch.tensor(7))
        outs.append((wc.view(torch.int16).clone(), v.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_opcheck_sinkgd_step():
    w = [torch.randn(5, 4), torch.randn(2, 3, 6, dtype=torch.bfloat16)]
    g = [torch.randn(5, 4), torch.randn(2, 3, 6, dtype=torch.bfloat16)]
    v = [torch.ones(1, 4) / 2, torch.ones(2, 6) / math.sqrt(6)]
    torch.library.opcheck(OPS.sinkgd_step, _op_args(w, g, spectral_vecs=v, sinkhorn_iters=1, spectral_norm=True))
    torch.library.opcheck(OPS.sinkgd_step, _op_args(w, g, weight_decay=0.1, sinkhorn_iters=1, base_width=64.0))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(40, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 40))


def _loss(model, x):
    return torch.nn.functional.cross_entropy(model(x), (x * 7) % 40)


@PLAIN_ONLY
def test_optimizer_decreases_loss():
    model = _model()
    opt = SinkGD(sinkgd_param_groups(model, lr=1e-2), lr=0.3)
    x = torch.arange(40)
    first = None
    for _ in range(40):
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert loss.item() < 0.7 * first


def test_optimizer_step_matches_float64_formula():
    """One optimizer step with every setting away from its default: the optimizer hands each
    one to the op under the right name."""
    from torch_fused.optim.sinkgd import _warm_start

    gen = torch.Generator().manual_seed(2)
    shapes = [(6, 9), (2, 4, 70)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    w0 = [p.detach().clone() for p in params]
    v0 = [_warm_start(p) for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    kw = dict(sinkhorn_iters=2, lr_scale=0.2, weight_decay=0.1, spectral_norm=True, spectral_target="muon",
              spectral_iters=2, base_width=32.0, width_exponent=0.5)
    SinkGD(params, lr=torch.tensor(0.4), **kw).step()
    for p, w, v in zip(params, w0, v0):
        ref, _ = ref_sinkgd(w, p.grad, 0.4, iters=2, lr_scale=0.2, wd=0.1, spectral=True, target="muon",
                            spectral_iters=2, v=v, base_width=32.0, width_exponent=0.5)
        _assert_update_close(p.detach(), ref, w, torch.float32, f"{tuple(w.shape)}: ")


def _names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_param_groups_route_embeddings_head_and_tied_weights():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 8)
            self.block = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 10, bias=False)
            self.lm_head.weight = self.embed_tokens.weight  # tied

    m = LM()
    groups = sinkgd_param_groups(m, weight_decay=0.0)
    sink = {id(p) for p in groups[0]["params"]}
    assert sink == {id(m.block.weight)}
    rest = {id(p) for p in groups[1]["params"]}
    assert id(m.embed_tokens.weight) in rest and id(m.block.bias) in rest and id(m.norm.weight) in rest
    assert len(groups[1]["params"]) == len(rest)  # the tied weight appears once
    assert groups[1]["use_fallback"] and groups[1]["weight_decay"] == 0.0


def _bert_like(tied: bool, with_getter: bool):
    """The module tree of a BERT masked LM (names as in transformers), tiny. Its layers have
    submodules named ``output`` that are hidden layers, not the output head."""
    lin, mod = torch.nn.Linear, torch.nn.Module

    def tree(**children):
        m = mod()
        for k, v in children.items():
            setattr(m, k, v)
        return m

    layer = tree(attention=tree(self=tree(query=lin(8, 8), key=lin(8, 8), value=lin(8, 8)),
                                output=tree(dense=lin(8, 8), LayerNorm=torch.nn.LayerNorm(8))),
                 intermediate=tree(dense=lin(8, 16)), output=tree(dense=lin(16, 8), LayerNorm=torch.nn.LayerNorm(8)))

    class Bert(mod):
        def __init__(self):
            super().__init__()
            self.embeddings = tree(word_embeddings=torch.nn.Embedding(20, 8), position_embeddings=torch.nn.Embedding(6, 8))
            self.encoder = tree(layer=torch.nn.ModuleList([layer]))
            self.cls = tree(predictions=tree(transform=tree(dense=lin(8, 8)), decoder=lin(8, 20)))
            if tied:
                self.cls.predictions.decoder.weight = self.embeddings.word_embeddings.weight

    if with_getter:
        Bert.get_output_embeddings = lambda self: self.cls.predictions.decoder
    return Bert()


@pytest.mark.parametrize("tied,with_getter", [(True, True), (False, True), (True, False)])
def test_param_groups_find_the_head_by_module_not_by_name(tied, with_getter):
    m = _bert_like(tied, with_getter)
    groups = sinkgd_param_groups(m)
    hidden = {f"encoder.layer.0.{n}.weight" for n in ("attention.self.query", "attention.self.key",
                                                      "attention.self.value", "attention.output.dense",
                                                      "intermediate.dense", "output.dense")}
    assert _names(m, groups[0]["params"]) == hidden | {"cls.predictions.transform.dense.weight"}
    rest = _names(m, groups[1]["params"])
    assert {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
            "encoder.layer.0.attention.output.dense.bias"} <= rest
    # the decoder: by get_output_embeddings, or (without it) by its tie to the word embeddings
    # (a tied decoder weight is the word embedding's Parameter itself: checked by identity)
    dec = m.cls.predictions.decoder.weight
    assert any(p is dec for p in groups[1]["params"]) and not any(p is dec for p in groups[0]["params"])
    assert "cls.predictions.decoder.bias" in rest
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(m.parameters()))


def test_param_groups_tied_final_linear_and_lm_head_name():
    class TiedHead(torch.nn.Module):  # no get_output_embeddings; the head is tied, not named lm_head
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(12, 8)
            self.output = torch.nn.Linear(8, 8)  # a hidden layer that happens to be named output
            self.head = torch.nn.Linear(8, 12)
            self.head.weight = self.wte.weight

    m = TiedHead()
    groups = sinkgd_param_groups(m)
    assert _names(m, groups[0]["params"]) == {"output.weight"}
    assert _names(m, groups[1]["params"]) == {"wte.weight", "output.bias", "head.bias"}

    class Untied(torch.nn.Module):  # no get_output_embeddings: a module named exactly lm_head
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 8)
            self.lm_head = torch.nn.Linear(8, 12, bias=False)
            self.lm_head_proj = torch.nn.Linear(8, 8, bias=False)  # not the exact name

        def get_output_embeddings(self):
            return None  # as transformers' base class for models without a head

    m = Untied()
    groups = sinkgd_param_groups(m)
    assert _names(m, groups[0]["params"]) == {"body.weight", "lm_head_proj.weight"}
    assert _names(m, groups[1]["params"]) == {"body.bias", "lm_head.weight"}


@PLAIN_ONLY
def test_state_dict_round_trip_gives_identical_next_step():
    kw = dict(lr=0.2, spectral_norm=True, weight_decay=0.01)
    m1 = _model()
    o1 = SinkGD(sinkgd_param_groups(m1, lr=1e-2), **kw)
    x = torch.arange(40)
    for _ in range(3):
        o1.zero_grad()
        _loss(m1, x).backward()
        o1.step()
    m2 = _model()
    m2.load_state_dict(m1.state_dict())
    o2 = SinkGD(sinkgd_param_groups(m2, lr=1e-2), **kw)
    buf = io.BytesIO()  # a real save/load: the loaded state shares no tensor with o1's
    torch.save(o1.state_dict(), buf)
    buf.seek(0)
    o2.load_state_dict(torch.load(buf))
    for m, o in ((m1, o1), (m2, o2)):
        o.zero_grad()
        _loss(m, x).backward()
        o.step()
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)


def test_load_state_dict_hooks_see_and_set_the_warm_start_vectors():
    """A load pre-hook's returned state_dict is what loads, the warm-start vectors included (they
    were taken from the state_dict before the hooks ran), and post-hooks see them float32."""
    lin = torch.nn.Linear(4, 5).to(torch.bfloat16)
    opt = SinkGD(lin.parameters(), lr=0.3, spectral_norm=True, fallback_kwargs={"lr": 1e-3})
    lin.weight.grad, lin.bias.grad = torch.randn(5, 4).bfloat16(), torch.randn(5).bfloat16()
    opt.step()
    sd = opt.state_dict()
    new_v = torch.full((1, 4), 0.5)

    def replace_vectors(_, state_dict):
        state_dict = copy.deepcopy(state_dict)
        for st in state_dict["state"].values():
            if "spectral_v" in st:
                st["spectral_v"] = new_v.clone()
            st.pop("exp_avg", None)
        return state_dict

    seen = []
    new = SinkGD(lin.parameters(), lr=0.3, spectral_norm=True, fallback_kwargs={"lr": 1e-3})
    new.register_load_state_dict_pre_hook(replace_vectors)
    new.register_load_state_dict_post_hook(lambda o: seen.append(o.state[lin.weight]["spectral_v"].dtype))
    new.load_state_dict(sd)
    assert torch.equal(new.state[lin.weight]["spectral_v"], new_v)
    assert "exp_avg" not in new.state[lin.bias]
    assert seen == [torch.float32]
    # and without hooks the saved vector comes back as it was, float32 beside bf16 weights
    plain = SinkGD(lin.parameters(), lr=0.3, spectral_norm=True, fallback_kwargs={"lr": 1e-3})
    plain.load_state_dict(sd)
    assert torch.equal(plain.state[lin.weight]["spectral_v"], opt.state[lin.weight]["spectral_v"])


def test_params_without_grad_are_skipped_and_bad_params_raise():
    a = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(torch.randn(4, 4))
    a.grad = torch.randn(4, 4)
    opt = SinkGD([a, b], lr=0.1)
    b0 = b.detach().clone()
    opt.step()
    assert torch.equal(b.detach(), b0)
    nc = torch.nn.Parameter(torch.randn(6, 4).t())  # non-contiguous
    nc.grad = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"params\[0\]: expected a contiguous parameter"):
        SinkGD([nc], lr=0.1).step()
    w = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"grads\[0\]: shape \(4, 5\) does not match its parameter's \(4, 4\)"):
        sinkgd_step([w], [torch.randn(4, 5)], lr=0.1)
    with pytest.raises(ValueError, match=r"spectral_vecs: expected one vector per parameter \(1\), got 0"):
        sinkgd_step([w], [torch.randn(4, 4)], lr=0.1, spectral_norm=True)
    with pytest.raises(ValueError, match="spectral_target"):
        SinkGD([a], lr=0.1, spectral_target="frob")


@PLAIN_ONLY
def test_compiled_step_matches_eager_without_recompiling_on_lr_change():
    from torch._dynamo.testing import CompileCounterWithBackend

    x = torch.arange(40)
    runs = []
    for compiled in (False, True):
        model = _model()
        lr = torch.tensor(0.2)
        opt = SinkGD(sinkgd_param_groups(model, lr=1e-2), lr=lr, spectral_norm=True)
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("inductor")
        step = torch.compile(lambda: opt.step(), fullgraph=True, backend=cnt) if compiled else opt.step
        frames_after_warmup = None
        for i in range(6):
            opt.zero_grad()
            _loss(model, x).backward()
            step()
            lr.fill_(0.2 / (i + 2))  # a schedule: in place, no recompile
            if i == 1:  # the first step initializes the state (one more graph); then none
                frames_after_warmup = cnt.frame_count
        runs.append([p.detach().clone() for p in model.parameters()])
        if compiled:
            assert cnt.frame_count == frames_after_warmup, f"recompiled: {frames_after_warmup} -> {cnt.frame_count}"
            assert frames_after_warmup <= 2
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@PLAIN_ONLY
@pytest.mark.parametrize("spectral", [False, True], ids=["plain", "spectral"])
def test_compiled_step_keeps_the_state_of_a_group_mixing_vectors_and_matrices(spectral):
    """torch.compile(opt.step, fullgraph=True) with a later group holding both a vector (AdamW)
    and a matrix (SinkGD), the layout of per-layer lr groups: the compiled steps give the eager
    steps' parameters, step counts and warm-start vectors. (The AdamW step once read the state
    inside the trace, and the compiled step's replay of that read dropped the matrix's state made
    by _init_group in the same step: its step count lagged by one, and with spectral_norm the
    first update of its warm-start vector was lost.)"""
    runs = []
    for compiled in (False, True):
        gen = torch.Generator().manual_seed(0)
        a = torch.nn.Parameter(torch.randn(5, 4, generator=gen))
        b = torch.nn.Parameter(torch.randn(7, generator=gen))
        c = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
        opt = SinkGD([{"params": [a]}, {"params": [b, c], "fallback_kwargs": {"lr": 0.01}}], lr=0.3,
                     spectral_norm=spectral)
        torch._dynamo.reset()
        step = torch.compile(lambda: opt.step(), fullgraph=True) if compiled else opt.step
        counts = []
        for _ in range(3):
            for p in (a, b, c):
                p.grad = torch.randn(p.shape, generator=gen)
            step()
            counts.append([float(opt.state[p]["step"]) for p in (a, b, c)])
        vecs = [opt.state[p]["spectral_v"].clone() for p in (a, c)] if spectral else []
        runs.append(([p.detach().clone() for p in (a, b, c)], counts, vecs))
    (want, want_counts, want_vecs), (got, got_counts, got_vecs) = runs
    assert want_counts == [[k, k, k] for k in (1.0, 2.0, 3.0)]
    assert got_counts == want_counts
    for x, y in zip(got + got_vecs, want + want_vecs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_stays_within_one_bf16_step(device):
    if device == "cpu" and not INTERPRET:
        pytest.skip("stochastic rounding is a Triton-path feature; the CPU reference rounds to nearest")
    gen = torch.Generator().manual_seed(5)
    shape = (17, 65) if SMALL else (33, 65)
    w32 = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen).to(device)
    kw = dict(lr=0.01, sinkhorn_iters=1)
    w_sr = w32.to(torch.bfloat16).to(device)
    w_rn = w_sr.clone()
    sinkgd_step([w_sr], [g], stochastic_round=True, step=torch.tensor(3.0), **kw)
    sinkgd_step([w_rn], [g], **kw)
    # the fp32 result from the bf16 start, and its two bf16 neighbours
    exact = w32.to(torch.bfloat16).float().to(device)
    sinkgd_step([exact], [g], **kw)
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 8)
    assert bool(((w_sr.float() - exact).abs() <= ulp).all())
    assert not torch.equal(w_sr, w_rn)  # some elements rounded the other way


@pytest.mark.skipif(not INTERPRET, reason="documents the interpreter's cast behind a bf16 tolerance above")
def test_interpreter_bf16_cast_truncates():
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x, y):
        o = tl.arange(0, 2)
        tl.store(y + o, tl.load(x + o).to(tl.bfloat16))

    x = torch.tensor([1.0 + 2**-8 + 2**-10, -1.0 - 2**-8 - 2**-10])
    y = torch.empty(2, dtype=torch.bfloat16)
    cast[(1,)](x, y)
    assert y.float().tolist() == [1.0, -1.0]  # round-to-nearest would give +-1.0078125


@pytest.mark.parametrize("device", DEVICES)
def test_list_step_equals_single_steps(device):
    """One multi-tensor launch per stage serves a list of mixed shapes and dtypes exactly as
    separate calls do (each matrix's sums are its own: bitwise equal). The bf16 and fp32 groups
    mix both load classes (n a multiple of 16 bytes' worth or not: separate update launches),
    with per-matrix lr factors (base_width) and weight decay."""
    gen = torch.Generator().manual_seed(11)
    if SMALL:  # rows wider than 64 take the two-pass path here (tests/conftest.py)
        shapes = [(3, 70), (21, 8), (2, 9, 32), (1, 1), (2, 150), (5, 5)]
    else:
        shapes = [(3, 70), (65, 8), (2, 17, 32), (1, 1), (40, 1030), (5, 5)]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16]
    ws = [torch.randn(s, generator=gen).to(dt).to(device) for s, dt in zip(shapes, dtypes)]
    gs = [torch.randn(s, generator=gen).to(dt).to(device) for s, dt in zip(shapes, dtypes)]
    kw = dict(lr=0.3, weight_decay=0.02, sinkhorn_iters=2 if SMALL else 3, base_width=32.0, width_exponent=0.5)
    together = [w.clone() for w in ws]
    sinkgd_step(together, gs, **kw)
    for w, g, t in zip(ws, gs, together):
        single = w.clone()
        sinkgd_step([single], [g], **kw)
        assert torch.equal(single, t)
        assert not torch.equal(single, w)


@pytest.mark.parametrize("device", DEVICES)
def test_cached_plan_follows_new_gradients_and_hyperparameters(device):
    """A SinkGDCache reuses its plans while addresses, shapes and lr-shape settings stay the
    same: a step with fresh gradient tensors, a later step on the same tensors, and a step with
    another lr_scale / base_width each give the reference result."""
    cache = SinkGDCache()
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 20), (2, 9, 4)]
    ws = [torch.randn(s, generator=gen).to(device) for s in shapes]
    lr = 0.2
    gs = [torch.randn(s, generator=gen).to(device) for s in shapes]
    for step, (lr_scale, base_width) in enumerate([(0.05, None), (0.05, None), (0.1, None), (0.1, 8.0)]):
        if step == 1:  # fresh gradient tensors (new addresses, most likely)
            gs = [torch.randn(s, generator=gen).to(device) for s in shapes]
        else:  # new values at the same addresses: only the settings tell the plans apart
            for g in gs:
                g.copy_(torch.randn(g.shape, generator=gen))
        before = [w.clone() for w in ws]
        sinkgd_step(ws, gs, lr=lr, lr_scale=lr_scale, sinkhorn_iters=1, base_width=base_width, cache=cache)
        for w, w0, g in zip(ws, before, gs):
            ref, _ = ref_sinkgd(w0.cpu(), g.cpu(), lr, iters=1, lr_scale=lr_scale, base_width=base_width)
            torch.testing.assert_close(w.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    if device == "cuda" or INTERPRET:  # the Triton path ran: its plans are keyed as documented
        n = len(cache.plans)
        assert 3 <= n <= 4  # one per lr-shape setting, and per gradient addresses
        gs = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for _ in range(2):
            sinkgd_step(ws, gs, lr=lr, lr_scale=0.1, sinkhorn_iters=1, base_width=8.0, cache=cache)
        assert len(cache.plans) <= n + 1  # one new key at most (gs' addresses), reused after
        sinkgd_step(ws, gs, lr=lr, lr_scale=0.3, sinkhorn_iters=1)  # no cache: nothing kept
        assert len(cache.plans) <= n + 1


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_call_still_checks_tensors_that_changed(device):
    """A cache skips the per-tensor checks of a call whose tensors match a checked one (same
    addresses, shapes, dtypes, devices, contiguity): a tensor that differs in any of those at
    the same address (a reshaped gradient, a transposed parameter, a vector of another shape)
    still gets the full checks' error, and the valid call keeps giving the reference result."""
    cache = SinkGDCache()
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(6, 10, generator=gen).to(device)
    g = torch.randn(6, 10, generator=gen).to(device)
    v = torch.randn(1, 10, generator=gen).abs().to(device) + 0.1
    kw = dict(lr=0.3, sinkhorn_iters=2, spectral_norm=True, spectral_target="muon", cache=cache)
    for _ in range(3):
        w0, v0 = w.clone(), v.clone()
        sinkgd_step([w], [g], spectral_vecs=[v], **kw)
        ref_w, ref_v = ref_sinkgd(w0.cpu(), g.cpu(), 0.3, iters=2, spectral=True, target="muon", v=v0.cpu())
        torch.testing.assert_close(w.cpu().double(), ref_w, rtol=1e-5, atol=1e-6)
    if device == "cuda" or INTERPRET:  # the Triton path ran: the checked call is remembered
        assert len(cache.calls) == 1
    with pytest.raises(ValueError, match=r"grads\[0\]: shape \(10, 6\)"):
        sinkgd_step([w], [g.view(10, 6)], spectral_vecs=[v], **kw)
    with pytest.raises(ValueError, match=r"params\[0\]: expected a contiguous parameter"):
        sinkgd_step([w.view(10, 6).t()], [g], spectral_vecs=[v], **kw)
    with pytest.raises(ValueError, match=r"spectral_vecs\[0\]: expected float32 of shape \(1, 10\)"):
        sinkgd_step([w], [g], spectral_vecs=[v.view(2, 5)], **kw)
    with pytest.raises(ValueError, match=r"spectral_vecs\[0\]: expected float32"):
        sinkgd_step([w], [g], spectral_vecs=[v.view(torch.int32)], **kw)
    w0, v0 = w.clone(), v.clone()
    sinkgd_step([w], [g], spectral_vecs=[v], **kw)
    ref_w, _ = ref_sinkgd(w0.cpu(), g.cpu(), 0.3, iters=2, spectral=True, target="muon", v=v0.cpu())
    torch.testing.assert_close(w.cpu().double(), ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_each_optimizer_owns_its_plans(device):
    """Plans live in the optimizer's own cache: two optimizers never share or evict each
    other's, and a copied optimizer starts with an empty one."""
    gen = torch.Generator().manual_seed(4)
    opts = []
    for _ in range(2):
        p = torch.nn.Parameter(torch.randn(5, 6, generator=gen).to(device))
        p.grad = torch.randn(5, 6, generator=gen).to(device)
        opts.append(SinkGD([p], lr=0.1, sinkhorn_iters=1))
    opts[0].step()
    triton_path = device == "cuda" or INTERPRET
    assert len(opts[0].plan_cache.plans) == (1 if triton_path else 0)
    assert len(opts[1].plan_cache.plans) == 0
    opts[1].step()
    assert opts[0].plan_cache is not opts[1].plan_cache
    assert len(opts[1].plan_cache.plans) == (1 if triton_path else 0)
    clone = copy.deepcopy(opts[0])
    assert isinstance(clone.plan_cache, SinkGDCache) and not clone.plan_cache.plans


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_fused_n", [0, 1 << 20], ids=["two-pass", "one-read"])
def test_row_pass_paths_match_reference(device, max_fused_n, settings_override):
    """Rows up to max_fused_n take the one-read row pass, wider ones the two-pass path; each
    path alone, on every shape, against the float64 reference (two iterations: the first,
    where r and c are still ones, and a later one)."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the CPU path is the reference implementation, not the kernels")
    from torch_fused.kernels import sinkgd as K

    settings_override(sinkgd_tiles=dataclasses.replace(K.tiles(), max_fused_n=max_fused_n))
    gen = torch.Generator().manual_seed(3)
    shapes = [(37, 50), (2, 9, 130), (70, 3)] + ([] if device == "cpu" else [(300, 3), (70, 2000), (5, 20000)])
    iters = 2 if device == "cpu" else 5
    ws = [torch.randn(s, generator=gen) for s in shapes]
    gs = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    got = [w.clone().to(device) for w in ws]
    sinkgd_step(got, [g.to(device) for g in gs], lr=0.5, weight_decay=0.1, sinkhorn_iters=iters)
    for w, g, out in zip(ws, gs, got):
        ref, _ = ref_sinkgd(w, g, 0.5, iters=iters, wd=0.1)
        err = (out.cpu().double() - ref).abs()
        bound = 2**-23 * ref.abs() + 1e-4 * (ref - w.double()).abs().max()
        assert bool((err <= bound).all()), f"{tuple(w.shape)}: max err {err.max().item():.3g}"


@NEEDS_TRITON
def test_row_pass_column_partials_stay_bounded_per_column(settings_override):
    """Extra memory stays O(rows + cols) per matrix: however tall the matrix, the row pass
    writes at most rows_max_partials column partials per column (its programs get more rows)."""
    from torch_fused.kernels import sinkgd as K
    from torch_fused.ops import sinkgd as S

    settings_override(sinkgd_tiles=dataclasses.replace(K.tiles(), rows_max_partials=8))
    for m, n in [(5000, 8), (3, 40), (777, 1)]:
        p, g = torch.zeros(m, n), torch.zeros(m, n)
        plan = S._Plan([p], [g], 0.05, None, 1.0)
        (_, _, bm, *_), *_ = plan.fused[0]
        assert -(-m // bm) <= 8
        assert plan.lens[3] <= 8 * n + 3  # partials buffer, padded to 4 floats


@NEEDS_TRITON
def test_compile_cases_cover_every_kernel():
    """tests/test_kernels_compile.py compiles these for sm_90."""
    from torch_fused.kernels import sinkgd as K

    names = {fn.__name__ for _, fn, *_ in K.compile_cases()}
    assert names == {"_sinkgd_rows_kernel", "_sinkgd_sums_kernel", "_sinkgd_scale_kernel", "_sinkgd_update_kernel",
                     "_sinkgd_power_rows_kernel", "_sinkgd_power_tiles_kernel", "_sinkgd_power_cols_kernel",
                     "_sinkgd_power_norm_kernel", "_sinkgd_colsum_kernel"}


SPECTRAL_SHAPES = [(37, 50), (2, 9, 130), (70, 3), (6, 20)]  # (6, 20): its gradient is all zeros


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_fused_n", [0, 1 << 20], ids=["two-pass", "one-read"])
@pytest.mark.parametrize("dtype,target,spectral_iters,iters", [
    (torch.float32, "unit", 2, 2), (torch.bfloat16, "muon", 1, 1), (torch.float16, "muon", 3, 0)])
def test_spectral_step_paths_match_reference(device, max_fused_n, dtype, target, spectral_iters, iters,
                                             settings_override):
    """The spectral step on each row-pass path (max_fused_n = 0: every matrix takes the
    two-pass power pass; 1 << 20: the one-read one): batched, tall, short and all-zero
    gradients in one multi-tensor call, every grad dtype, both targets, several power
    iterations and sinkhorn_iters = 0, against the float64 reference (W and the warm-start
    vectors it writes back)."""
    from torch_fused.kernels import sinkgd as K

    settings_override(sinkgd_tiles=dataclasses.replace(K.tiles(), max_fused_n=max_fused_n))
    gen = torch.Generator().manual_seed(9)
    ws = [torch.randn(s, generator=gen).to(dtype) for s in SPECTRAL_SHAPES]
    gs = [(torch.randn(s, generator=gen) * 1e-2).to(dtype) for s in SPECTRAL_SHAPES]
    gs[-1].zero_()
    vs = [torch.nn.functional.normalize(torch.randn(w.numel() // (s[-2] * s[-1]), s[-1], generator=gen), dim=1)
          for w, s in zip(ws, SPECTRAL_SHAPES)]
    got = [w.clone().to(device) for w in ws]
    got_v = [v.clone().to(device) for v in vs]
    sinkgd_step(got, [g.to(device) for g in gs], lr=0.5, spectral_vecs=got_v, weight_decay=0.1,
                sinkhorn_iters=iters, spectral_norm=True, spectral_target=target, spectral_iters=spectral_iters)
    for w, g, v, out, out_v in zip(ws, gs, vs, got, got_v):
        ref_w, ref_v = ref_sinkgd(w, g, 0.5, iters=iters, wd=0.1, spectral=True, target=target,
                                  spectral_iters=spectral_iters, v=v)
        _assert_update_close(out, ref_w, w, dtype, f"{tuple(w.shape)}: ")
        torch.testing.assert_close(out_v.cpu().double(), ref_v, rtol=1e-4, atol=1e-5)
    # zero gradient: w = 0, and v restarts from the dense restart vector (v = w / |w| would be 0)
    restart = torch.cos(0.5 + 2.399963 * torch.arange(vs[-1].shape[-1], dtype=torch.float32))
    torch.testing.assert_close(got_v[-1].cpu(), restart.expand_as(vs[-1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spectral_iters", [1, 2])
def test_a_zero_gradient_step_does_not_break_the_spectral_estimate(device, spectral_iters):
    """A spectral step on an all-zero gradient (a batch whose mask keeps no token) left v = 0 for
    good: every later step of that matrix then had w = 0 and the scale target / eps, an update
    about 1e8 times the normalized one. Now v restarts and the next real step equals the step
    from a fresh warm start; a v that is already 0 (an old checkpoint) gives a finite step."""
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(2, 8, 6, generator=gen).to(device)
    g = torch.randn(2, 8, 6, generator=gen).to(device)
    kw = dict(lr=1.0, sinkhorn_iters=1, spectral_norm=True, spectral_target="muon", spectral_iters=spectral_iters)
    warm = torch.cos(0.5 + 2.399963 * torch.arange(6, dtype=torch.float32))
    fresh_w, fresh_v = w0.clone(), (warm / warm.norm()).expand(2, 6).clone().to(device)
    sinkgd_step([fresh_w], [g], spectral_vecs=[fresh_v], **kw)
    after_w, after_v = w0.clone(), (warm / warm.norm()).expand(2, 6).clone().to(device)
    sinkgd_step([after_w], [torch.zeros_like(g)], spectral_vecs=[after_v], **kw)
    assert torch.equal(after_w, w0)  # no update from a zero gradient
    assert bool((after_v.norm(dim=1) > 0).all()), after_v
    sinkgd_step([after_w], [g], spectral_vecs=[after_v], **kw)
    torch.testing.assert_close(after_w, fresh_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after_v, fresh_v, rtol=1e-4, atol=1e-5)
    # a warm-start vector that is 0 already: its first power iteration restarts it and leaves X
    # out, so one iteration leaves W as it was, and two equal one from the fresh warm start
    zero_w, zero_v = w0.clone(), torch.zeros(2, 6, device=device)
    sinkgd_step([zero_w], [g], spectral_vecs=[zero_v], **kw)
    if spectral_iters == 1:
        assert torch.equal(zero_w, w0)
    else:
        one_w, one_v = w0.clone(), (warm / warm.norm()).expand(2, 6).clone().to(device)
        sinkgd_step([one_w], [g], spectral_vecs=[one_v], **{**kw, "spectral_iters": 1})
        torch.testing.assert_close(zero_w, one_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(zero_v, one_v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_spectral_step_with_non_contiguous_vector(device):
    """A warm-start vector that is a non-contiguous view is updated in place like any other."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 9, 12, generator=gen)
    g = torch.randn(2, 9, 12, generator=gen)
    base = torch.nn.functional.normalize(torch.randn(12, 2, generator=gen), dim=0)
    v = base.clone().to(device).t()  # [2, 12], strides (1, 2)
    out = w.clone().to(device)
    sinkgd_step([out], [g.to(device)], lr=0.5, spectral_vecs=[v], sinkhorn_iters=1, spectral_norm=True)
    ref_w, ref_v = ref_sinkgd(w, g, 0.5, iters=1, spectral=True, v=base.t())
    _assert_update_close(out, ref_w, w, torch.float32)
    torch.testing.assert_close(v.cpu().double(), ref_v, rtol=1e-4, atol=1e-5)


def test_bad_spectral_vectors_raise():
    """A vector of the wrong shape, dtype or device is named, not read out of bounds."""
    w = [torch.randn(4, 4), torch.randn(2, 3, 5)]
    g = [torch.randn_like(x) for x in w]
    good = [torch.ones(1, 4) / 2, torch.ones(2, 5)]
    for i, bad, what in [(0, torch.ones(1, 4, device="meta"), r"device meta differs from its parameter's cpu"),
                         (1, torch.ones(1, 5), r"expected float32 of shape \(2, 5\), got torch.float32 \(1, 5\)"),
                         (1, torch.ones(2, 4), r"expected float32 of shape \(2, 5\)"),
                         (0, torch.ones(1, 4, dtype=torch.float64), r"expected float32 of shape \(1, 4\), got torch.float64")]:
        vecs = list(good)
        vecs[i] = bad
        with pytest.raises(ValueError, match=rf"spectral_vecs\[{i}\]: {what}"):
            sinkgd_step(w, g, lr=0.1, spectral_vecs=vecs, spectral_norm=True)


@pytest.mark.parametrize("device", DEVICES)
def test_op_reuses_its_plans_and_keys_them_by_tile_settings(device, monkeypatch, settings_override):
    """Calls of the op without a SinkGDCache (a compiled step) reuse the op's own plans for the
    same tensors; a changed tile constant (a sweep) gets a new plan, never a stale one."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the CPU path is the reference implementation: no plans")
    from torch_fused.kernels import sinkgd as K
    from torch_fused.ops import sinkgd as S

    monkeypatch.setattr(S, "_OP_CACHE", SinkGDCache(cuda_graphs=False))
    gen = torch.Generator().manual_seed(6)
    shapes = [(9, 20), (2, 5, 12)]
    ws = [torch.randn(s, generator=gen).to(device) for s in shapes]
    gs = [torch.randn(s, generator=gen).to(device) for s in shapes]
    for _ in range(2):
        sinkgd_step(ws, gs, lr=0.1, sinkhorn_iters=1)
        plans = list(S._OP_CACHE.plans.values())
        assert len(plans) == 1
        if _ == 0:
            first = plans[0]
    assert plans[0] is first
    settings_override(sinkgd_tiles=dataclasses.replace(K.tiles(), rows_bm=K.tiles().rows_bm * 2))
    before = [w.clone() for w in ws]
    sinkgd_step(ws, gs, lr=0.1, sinkhorn_iters=1)
    assert len(S._OP_CACHE.plans) == 2
    for w, w0, g in zip(ws, before, gs):
        ref, _ = ref_sinkgd(w0.cpu(), g.cpu(), 0.1, iters=1)
        torch.testing.assert_close(w.cpu().double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_spectral_step_launches_do_not_grow_with_matrices(device, monkeypatch):
    """The spectral step is multi-tensor like the rest: per power iteration one power row pass
    per row-length class, one column and one normalization launch, whatever the number of
    matrices (here 2, then 6, of the same two classes; the interpreter run also has wide ones)."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the CPU path is the reference implementation, not the kernels")
    from torch_fused.kernels import sinkgd as K

    counts: dict = {}

    class Counting:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            counts[self.name] = counts.get(self.name, 0) + 1
            return self.kernel[grid]

    for name in ("_sinkgd_power_rows_kernel", "_sinkgd_power_tiles_kernel", "_sinkgd_power_cols_kernel",
                 "_sinkgd_power_norm_kernel"):
        monkeypatch.setattr(K, name, Counting(name, getattr(K, name)))
    gen = torch.Generator().manual_seed(8)
    per_size = []
    for k in (1, 3):
        shapes = [(7, 16), (5, 100)] * k
        ws = [torch.randn(s, generator=gen).to(device) for s in shapes]
        vs = [torch.nn.functional.normalize(torch.randn(1, s[-1], generator=gen), dim=1).to(device) for s in shapes]
        counts.clear()
        sinkgd_step(ws, [torch.randn(s, generator=gen).to(device) for s in shapes], lr=0.1, spectral_vecs=vs,
                    sinkhorn_iters=1, spectral_norm=True, spectral_iters=2)
        per_size.append(dict(counts))
    assert per_size[0] == per_size[1]
    assert per_size[0]["_sinkgd_power_cols_kernel"] == 2 and per_size[0]["_sinkgd_power_norm_kernel"] == 2


def test_fallback_group_settings_reach_its_adamw():
    """A use_fallback group's own lr, weight_decay, eps and betas (sinkgd_param_groups' keyword
    arguments) are its AdamW's, over fallback_kwargs; a scheduler's lr change applies; without
    them fallback_kwargs hold. Compared with torch.optim.AdamW on copies."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 4)
    mat = torch.nn.Linear(4, 4, bias=False)
    model = torch.nn.Sequential(emb, mat)
    ref_emb = copy.deepcopy(emb)
    opt = SinkGD(sinkgd_param_groups(model, lr=0.1, weight_decay=0.5, betas=(0.8, 0.9), eps=1e-6), lr=0.3,
                 fallback_kwargs=dict(lr=7.0, weight_decay=0.0, eps=1e-3))
    ref = torch.optim.AdamW(ref_emb.parameters(), lr=0.1, weight_decay=0.5, betas=(0.8, 0.9), eps=1e-6)
    for it in range(3):
        if it == 2:  # a scheduler changes the AdamW group's lr
            opt.param_groups[1]["lr"] = ref.param_groups[0]["lr"] = 0.02
        g = torch.randn(6, 4)
        emb.weight.grad, ref_emb.weight.grad = g.clone(), g.clone()
        mat.weight.grad = torch.randn(4, 4)
        opt.step()
        ref.step()
        torch.testing.assert_close(emb.weight, ref_emb.weight, rtol=1e-6, atol=1e-7)
    # a group that names none of them: fallback_kwargs, then AdamW's defaults
    w = torch.nn.Parameter(torch.randn(5))
    w_ref = torch.nn.Parameter(w.detach().clone())
    opt2 = SinkGD([{"params": [w], "use_fallback": True}], lr=0.3, fallback_kwargs=dict(lr=0.05, weight_decay=0.2))
    ref2 = torch.optim.AdamW([w_ref], lr=0.05, weight_decay=0.2)
    w.grad = torch.randn(5)
    w_ref.grad = w.grad.clone()
    opt2.step()
    ref2.step()
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_step_count_stays_with_the_group_when_a_matrix_has_no_gradient():
    """The step count (the stochastic-rounding seed) lives with the group's first matrix: a
    step where that matrix has no gradient still counts on, and no second count appears."""
    p1 = torch.nn.Parameter(torch.randn(4, 8))
    p2 = torch.nn.Parameter(torch.randn(4, 8))
    opt = SinkGD([p1, p2], lr=0.1, stochastic_round=True)
    for it in range(4):
        p1.grad = torch.randn_like(p1) if it != 1 else None
        p2.grad = torch.randn_like(p2)
        opt.step()
    assert float(opt.state[p1]["step"]) == 4.0
    assert "step" not in opt.state[p2]


class _ByHand:
    """An lr 'schedule' set by hand on the param groups (no scheduler object)."""

    def __init__(self, opt):
        self.opt = opt

    def step(self):
        for group in self.opt.param_groups:
            group["lr"] = group["lr"] * 0.1


@pytest.mark.parametrize("schedule", ["StepLR", "ReduceLROnPlateau", "by hand"])
def test_fallback_kwargs_lr_follows_an_lr_scheduler(schedule):
    """An lr scheduler scales every lr of the optimizer: a fallback_kwargs lr (biases, here) by
    the same factor as the group's lr, against torch.optim.AdamW under the same schedule; also
    ReduceLROnPlateau, which records no initial_lr (the biases kept the full lr there), and an
    lr set by hand."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 3)
    bias_ref = torch.nn.Parameter(lin.bias.detach().clone())
    opt = SinkGD(lin.parameters(), lr=0.4, fallback_kwargs=dict(lr=0.01))
    ref = torch.optim.AdamW([bias_ref], lr=0.01, weight_decay=0.0)
    if schedule == "StepLR":
        sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1) for o in (opt, ref))
    elif schedule == "ReduceLROnPlateau":  # a metric that never improves: x0.1 after every step
        sched, ref_sched = (torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.1, patience=0) for o in (opt, ref))
    else:
        sched, ref_sched = _ByHand(opt), _ByHand(ref)
    for _ in range(4):
        g = torch.randn(3)
        lin.weight.grad, lin.bias.grad, bias_ref.grad = torch.randn(3, 4), g.clone(), g.clone()
        opt.step()
        ref.step()
        for sch in (sched, ref_sched):
            sch.step(1.0) if schedule == "ReduceLROnPlateau" else sch.step()
        torch.testing.assert_close(lin.bias, bias_ref, rtol=1e-6, atol=1e-7)
    assert ref.param_groups[0]["lr"] < 1e-4  # the schedule did cut the lr


def _schedule(name, opt, peak):
    """The lr scheduler ``name`` on ``opt`` for a run of 6 steps whose largest lr is ``peak``
    (the lr the optimizer was constructed with): each of these sets the groups' lr when it is
    constructed, OneCycleLR and CyclicLR from lrs of their own (max_lr / div_factor, base_lr,
    also recorded as initial_lr), the rest as a factor of the constructed lr."""
    S = torch.optim.lr_scheduler
    if name == "OneCycleLR":  # a warm-up from peak / 25 (initial_lr), then a cosine decay
        return S.OneCycleLR(opt, max_lr=peak, total_steps=6, pct_start=0.5, cycle_momentum=False)
    if name == "CyclicLR":  # from peak / 10 up to peak and back
        return S.CyclicLR(opt, base_lr=peak / 10, max_lr=peak, step_size_up=2, cycle_momentum=False)
    if name == "LinearLR":
        return S.LinearLR(opt, start_factor=0.1, total_iters=3)
    if name == "ConstantLR":
        return S.ConstantLR(opt, factor=0.25, total_iters=2)
    if name == "LambdaLR":
        return S.LambdaLR(opt, lambda k: (k + 1) / 4 if k < 3 else 0.5 ** (k - 2))
    return S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.2, total_iters=2),
                                S.CosineAnnealingLR(opt, T_max=4)], milestones=[2])


@pytest.mark.parametrize("schedule", ["OneCycleLR", "CyclicLR", "LinearLR", "ConstantLR", "LambdaLR",
                                      "SequentialLR"])
def test_fallback_kwargs_lr_follows_a_scheduler_that_sets_the_lr_at_construction(schedule):
    """A scheduler that sets the groups' lr when it is constructed (a warm-up's start): the
    fallback_kwargs lr (biases, here) moves by the group's lr over the lr SinkGD was constructed
    with (the schedule's peak), from the first step on, as torch.optim.AdamW under the same
    schedule at its own peak. OneCycleLR and CyclicLR record an initial_lr (peak / 25, peak / 10)
    below the constructed lr: taken as the base, it would give the biases 25x (10x) their lr at
    the start of the warm-up."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 3)
    bias_ref = torch.nn.Parameter(lin.bias.detach().clone())
    opt = SinkGD(lin.parameters(), lr=0.4, fallback_kwargs=dict(lr=0.01))
    ref = torch.optim.AdamW([bias_ref], lr=0.01, weight_decay=0.0)
    sched, ref_sched = _schedule(schedule, opt, 0.4), _schedule(schedule, ref, 0.01)
    lrs = []
    for _ in range(6):
        g = torch.randn(3)
        lin.weight.grad, lin.bias.grad, bias_ref.grad = torch.randn(3, 4), g.clone(), g.clone()
        lrs.append(ref.param_groups[0]["lr"])
        before = lin.bias.detach().clone()
        opt.step()
        ref.step()
        torch.testing.assert_close(lin.bias - before, bias_ref.detach() - before, rtol=1e-5, atol=1e-9,
                                   msg=lambda m: f"step {len(lrs)} at AdamW lr {lrs[-1]:.3g}: {m}")
        sched.step()
        ref_sched.step()
    assert min(lrs) < 0.5 * max(lrs)  # the schedule did move the lr


@pytest.mark.parametrize("schedule", ["OneCycleLR", "CyclicLR"])
def test_a_scheduler_cycling_momentum_is_refused(schedule):
    """OneCycleLR and CyclicLR cycle momentum by default: they refuse SinkGD (no momentum or
    betas setting), naming cycle_momentum; docs/SINKGD.md says to pass cycle_momentum=False."""
    opt = SinkGD(torch.nn.Linear(4, 3).parameters(), lr=0.4, fallback_kwargs=dict(lr=0.01))
    S = torch.optim.lr_scheduler
    with pytest.raises(ValueError, match="cycle_momentum"):
        if schedule == "OneCycleLR":
            S.OneCycleLR(opt, max_lr=0.4, total_steps=6)
        else:
            S.CyclicLR(opt, base_lr=0.04, max_lr=0.4)


def test_fallback_lr_base_of_a_checkpoint_saved_without_it():
    """A state_dict saved before the group's lr at construction was recorded: the loaded group
    takes the constructed group's record, so a hand-set lr still scales a fallback_kwargs lr;
    a group given fallback_kwargs=None takes none."""
    lin = torch.nn.Linear(4, 3)
    opt = SinkGD(lin.parameters(), lr=0.4, fallback_kwargs=dict(lr=0.01))
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["fallback_lr_base"]
    new = SinkGD(lin.parameters(), lr=0.4, fallback_kwargs=dict(lr=0.01))
    new.load_state_dict(sd)
    assert new.param_groups[0]["fallback_lr_base"] == 0.4
    new.param_groups[0]["lr"] = 0.04  # x0.1 by hand: the biases' AdamW lr too
    bias_ref = torch.nn.Parameter(lin.bias.detach().clone())
    ref = torch.optim.AdamW([bias_ref], lr=0.001, weight_decay=0.0)
    g = torch.randn(3)
    lin.weight.grad, lin.bias.grad, bias_ref.grad = torch.randn(3, 4), g.clone(), g.clone()
    new.step()
    ref.step()
    torch.testing.assert_close(lin.bias, bias_ref, rtol=1e-6, atol=1e-7)
    opt2 = SinkGD([{"params": [torch.nn.Parameter(torch.randn(3))], "fallback_kwargs": None, "lr": 0.01}])
    assert opt2.param_groups[0]["fallback_kwargs"] == {}


def test_hyperparameters_as_numpy_numbers_and_tensors_are_taken():
    """Config and sweep tools pass NumPy numbers: integers for the iteration counts, floats (or
    ints) for lr and the other float settings, NumPy bools for the flags; lr and lr_scale also
    as 0-dim floating-point tensors; as the step takes them."""
    np = pytest.importorskip("numpy")
    w = torch.nn.Parameter(torch.randn(4, 6))
    b = torch.nn.Parameter(torch.randn(6))
    for kw in (dict(sinkhorn_iters=np.int64(3), spectral_norm=True, spectral_iters=np.int32(2)),
               dict(lr_scale=np.float32(0.05), width_exponent=np.float64(0.5), base_width=4),
               dict(lr_scale=torch.tensor(0.05)),
               dict(lr=np.float32(0.1), weight_decay=np.float64(0.01), eps=np.float32(1e-6)),
               dict(lr=np.array(0.1), spectral_norm=np.bool_(True), stochastic_round=np.bool_(False)),
               dict(lr=1, base_width=np.int64(4)),
               dict(lr=np.int64(0)),
               dict(lr=torch.tensor(0.1, dtype=torch.float64)),
               dict(fallback_kwargs=dict(lr=np.float64(1e-3), betas=[np.float32(0.9), 0.95], eps=0, weight_decay=0)),
               dict(fallback_kwargs=dict(lr=torch.tensor(1e-3)))):
        kw = {"lr": 0.1, "fallback_kwargs": dict(lr=1e-3), **kw}
        opt = SinkGD([w, b], **kw)
        b.grad = torch.randn(6)
        w.grad = torch.randn(4, 6)
        opt.step()
        assert bool(torch.isfinite(w).all())


def test_a_use_fallback_groups_own_adamw_settings_are_checked():
    with pytest.raises(ValueError, match=r"param group betas: expected two floats in \[0, 1\)"):
        SinkGD([{"params": [torch.nn.Parameter(torch.randn(3))], "use_fallback": True, "betas": (0.9, 1.0)}])
    with pytest.raises(ValueError, match=r"param group betas: expected two floats in \[0, 1\)"):
        SinkGD([{"params": [torch.nn.Parameter(torch.randn(3))], "use_fallback": True, "betas": 0.9}])
    SinkGD([{"params": [torch.nn.Parameter(torch.randn(3))], "use_fallback": True, "betas": (0.8, 0.95)}])


@pytest.mark.parametrize("kw,msg", [
    (dict(fallback_kwargs=dict(amsgrad=True)), r"fallback_kwargs: SinkGD's AdamW takes .*; got amsgrad"),
    (dict(lr=torch.tensor(-0.1)), r"lr: expected a finite value >= 0, got a tensor holding -0.1"),
    (dict(lr=torch.tensor(float("inf"))), r"lr: expected a finite value >= 0, got a tensor holding inf"),
    (dict(lr="1e-3"), r"lr: expected a finite float >= 0 or a 0-dim floating-point tensor, got '1e-3'"),
    (dict(lr=None), r"lr: expected a finite float >= 0 or a 0-dim floating-point tensor, got None"),
    (dict(lr=True), r"lr: expected a finite float >= 0 or a 0-dim floating-point tensor, got True"),
    (dict(lr=float("inf")), r"lr: expected a finite float >= 0 or a 0-dim floating-point tensor, got inf"),
    (dict(lr=-1e-3), r"lr: expected a finite float >= 0 or a 0-dim floating-point tensor, got -0.001"),
    (dict(lr=torch.tensor([0.1])), r"lr: expected a float or a 0-dim floating-point tensor, got a tensor of shape \(1,\)"),
    (dict(lr=torch.tensor(1)), r"lr: expected a float or a 0-dim floating-point tensor, got .* dtype torch.int64"),
    (dict(weight_decay=-0.1), r"weight_decay: expected a finite float >= 0, got -0.1"),
    (dict(weight_decay="0.1"), r"weight_decay: expected a finite float >= 0, got '0.1'"),
    (dict(weight_decay=None), r"weight_decay: expected a finite float >= 0, got None"),
    (dict(base_width=0.0), r"base_width: expected None or a finite float > 0, got 0.0"),
    (dict(base_width="256"), r"base_width: expected None or a finite float > 0, got '256'"),
    (dict(eps=0.0), r"eps: expected a finite float > 0, got 0.0"),
    (dict(eps="1e-8"), r"eps: expected a finite float > 0, got '1e-8'"),
    (dict(eps=None), r"eps: expected a finite float > 0, got None"),
    (dict(sinkhorn_iters=None), r"sinkhorn_iters: expected an int >= 0, got None"),
    (dict(sinkhorn_iters=True), r"sinkhorn_iters: expected an int >= 0, got True"),
    (dict(lr_scale=torch.tensor([0.05])), r"lr_scale: expected a finite float >= 0, got tensor\(\[0\.05"),
    (dict(lr_scale="0.05"), r"lr_scale: expected a finite float >= 0, got '0.05'"),
    (dict(width_exponent=None), r"width_exponent: expected a finite float, got None"),
    (dict(spectral_target=None), r"spectral_target: expected 'unit' or 'muon', got None"),
    (dict(spectral_target=["unit"]), r"spectral_target: expected 'unit' or 'muon', got \['unit'\]"),
    (dict(spectral_norm="False"), r"spectral_norm: expected True or False, got 'False'"),
    (dict(spectral_norm=1), r"spectral_norm: expected True or False, got 1"),
    (dict(stochastic_round="yes"), r"stochastic_round: expected True or False, got 'yes'"),
    (dict(fallback_kwargs=0.01), r"fallback_kwargs: expected None or a dict of AdamW settings"),
    (dict(fallback_kwargs=[("lr", 0.01)]), r"fallback_kwargs: expected None or a dict of AdamW settings"),
    (dict(fallback_kwargs=dict(lr="1e-3")), r"fallback_kwargs lr: expected a finite float >= 0 or a 0-dim"),
    (dict(fallback_kwargs=dict(lr=torch.tensor([1e-3]))), r"fallback_kwargs lr: expected a float or a 0-dim"),
    (dict(fallback_kwargs=dict(eps=None)), r"fallback_kwargs eps: expected a finite float >= 0 for SinkGD's AdamW"),
    (dict(fallback_kwargs=dict(betas=("0.9", 0.99))), r"fallback_kwargs betas: expected two floats in \[0, 1\)"),
    (dict(fallback_kwargs=dict(betas=(0.9, None))), r"fallback_kwargs betas: expected two floats in \[0, 1\)"),
    (dict(sinkhorn_iters=2.5), r"sinkhorn_iters: expected an int >= 0, got 2.5"),
    (dict(lr_scale=float("nan")), r"lr_scale: expected a finite float >= 0, got nan"),
    (dict(lr_scale=-1.0), r"lr_scale: expected a finite float >= 0, got -1.0"),
    (dict(width_exponent="1"), r"width_exponent: expected a finite float, got '1'"),
    (dict(spectral_norm=True, spectral_iters=0), r"spectral_iters: expected an int >= 1 with spectral_norm=True, got 0"),
    (dict(spectral_iters=2.5), r"spectral_iters: expected an int >= 0, got 2.5"),
    (dict(fallback_kwargs=dict(betas=(0.9,))), r"fallback_kwargs betas: expected two floats in \[0, 1\)"),
    (dict(fallback_kwargs=dict(betas=(1.5, 0.9))), r"fallback_kwargs betas: expected two floats in \[0, 1\)"),
    (dict(fallback_kwargs=dict(lr=-1.0)), r"fallback_kwargs lr: expected a finite float >= 0 or .*, got -1.0"),
    (dict(fallback_kwargs=dict(eps=-1.0)), r"fallback_kwargs eps: expected a finite float >= 0 for SinkGD's AdamW, "
                                           r"got -1.0"),
    (dict(fallback_kwargs=dict(weight_decay=float("nan"))), r"fallback_kwargs weight_decay: expected a finite float >= 0"),
])
def test_bad_hyperparameters_raise_naming_them(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SinkGD([torch.nn.Parameter(torch.randn(3, 4))], **kw)
    # a param group's own settings are checked alike, at construction and in add_param_group
    with pytest.raises(ValueError, match=msg):
        SinkGD([{"params": [torch.nn.Parameter(torch.randn(3, 4))], **kw}])
    opt = SinkGD([torch.nn.Parameter(torch.randn(3, 4))])
    with pytest.raises(ValueError, match=msg):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 5))], **kw})


@pytest.mark.parametrize("lr", ["1e-3", True, None, -1.0, float("nan"), float("inf")])
def test_functional_step_bad_lr_raises_naming_it(lr):
    p, g = torch.randn(3, 4), torch.randn(3, 4)
    before = p.clone()
    with pytest.raises(ValueError, match=r"lr: expected a finite float >= 0 or a 0-dim tensor, got"):
        sinkgd_step([p], [g], lr=lr)
    assert torch.equal(p, before)


def test_bad_group_flags_and_param_groups_arguments_raise_naming_them():
    """A group's use_fallback (not a constructor argument) and sinkgd_param_groups' arguments:
    each error names the argument, as the constructor's do."""
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"use_fallback: expected True or False, got 'yes'"):
        SinkGD([{"params": [p], "use_fallback": "yes", "lr": 1e-3}])
    with pytest.raises(ValueError, match=r"lr: expected a finite float >= 0 or a 0-dim floating-point tensor, got '1'"):
        SinkGD([{"params": [p], "use_fallback": True, "lr": "1"}])
    with pytest.raises(ValueError, match=r"param group betas: expected two floats in \[0, 1\) for SinkGD's AdamW"):
        SinkGD([{"params": [p], "use_fallback": True, "lr": 1e-3, "betas": ("0.9", 0.99)}])
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"model: expected a torch.nn.Module, got list"):
        sinkgd_param_groups(list(model.parameters()))
    with pytest.raises(ValueError, match=r"sinkgd_param_groups: the AdamW group takes lr, weight_decay, eps, betas; "
                                         r"got spectral_norm, weight_decya"):
        sinkgd_param_groups(model, weight_decya=0.1, spectral_norm=True)
    with pytest.raises(ValueError, match=r"sinkgd_param_groups lr: expected a finite float >= 0 or a 0-dim"):
        sinkgd_param_groups(model, lr="3e-4")
    with pytest.raises(ValueError, match=r"sinkgd_param_groups betas: expected two floats in \[0, 1\)"):
        sinkgd_param_groups(model, betas=0.9)
    with pytest.raises(ValueError, match=r"sinkgd_param_groups weight_decay: expected a finite float >= 0"):
        sinkgd_param_groups(model, weight_decay=-0.1)
    groups = sinkgd_param_groups(model, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert groups[1]["lr"] == 3e-4 and groups[1]["use_fallback"] is True


def test_sparse_gradient_on_the_adamw_side_raises_before_any_update():
    """A sparse gradient where SinkGD's AdamW would take it raises a clear error before any
    parameter of any group moves (the SinkGD group comes first here)."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 4, bias=False)
    opt = SinkGD([{"params": [lin.weight]}, {"params": [emb.weight], "use_fallback": True, "lr": 1e-3}], lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    lin.weight.grad = torch.randn(4, 4)
    before = [lin.weight.detach().clone(), emb.weight.detach().clone()]
    with pytest.raises(ValueError, match=r"params: .*shape \(10, 4\).*sparse gradient"):
        opt.step()
    assert torch.equal(lin.weight, before[0]) and torch.equal(emb.weight, before[1])
    assert float(opt.state[lin.weight].get("step", 0.0)) == 0.0  # no step counted


@pytest.mark.parametrize("bad", ["sparse gradient", "non-contiguous"])
def test_a_bad_matrix_in_a_later_group_raises_before_any_update(bad):
    """A matrix the op rejects, in the second group: the step raises naming it by its group and
    index there, before the first group's matrix moves or any step count advances."""
    a = torch.nn.Parameter(torch.randn(4, 4))
    a.grad = torch.randn(4, 4)
    ok = torch.nn.Parameter(torch.randn(3, 4))
    ok.grad = torch.randn(3, 4)
    if bad == "sparse gradient":
        emb = torch.nn.Embedding(10, 4, sparse=True)
        emb(torch.tensor([1, 2])).sum().backward()
        p, msg = emb.weight, "sparse parameters or gradients are not supported"
    elif bad == "non-contiguous":
        p = torch.nn.Parameter(torch.randn(6, 4).t())
        p.grad = torch.randn(4, 6)
        msg = r"expected a contiguous parameter, got strides \(1, 4\)"
    opt = SinkGD([{"params": [a]}, {"params": [ok, p]}], lr=0.1)
    before = [t.detach().clone() for t in (a, ok, p)]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\]: " + msg):
        opt.step()
    assert all(torch.equal(t.detach(), b) for t, b in zip((a, ok, p), before))
    assert all(float(opt.state[t].get("step", 0.0)) == 0.0 for t in (a, ok))


def test_spectral_warm_start_of_an_empty_matrix():
    p = torch.nn.Parameter(torch.zeros(0, 4))
    q = torch.nn.Parameter(torch.randn(3, 4))
    opt = SinkGD([p, q], lr=0.1, spectral_norm=True)
    p.grad, q.grad = torch.zeros(0, 4), torch.randn(3, 4)
    opt.step()
    assert opt.state[p]["spectral_v"].shape == (1, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spectral", [False, True])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_huge_gradients_give_the_finite_normalized_step(device, spectral, gdtype):
    """SinkGD normalizes the gradient, so scaling it by 2^k (exact in every float dtype) must not
    change the step: the row and column norms are computed scaled, and a gradient whose squares
    overflow fp32 (entries past about 1.8e19 / sqrt(n)) is neither skipped (W unchanged) nor NaN.
    Rows up to 48 wide take the kernels' one-read row pass (the interpreter's max_fused_n is 64)."""
    if INTERPRET and (gdtype == torch.float32) == spectral:
        pytest.skip("the interpreter run takes fp32 plain and bf16 spectral (each kernel load and pass once)")
    g0 = torch.Generator().manual_seed(7)
    w = torch.randn(2, 24, 48, generator=g0).to(device)
    g = torch.randn(2, 24, 48, generator=g0).to(gdtype).to(device)
    v = torch.randn(2, 48, generator=g0).to(device)
    deltas = []
    for k in (0, 80, 120):
        wk, vk = w.clone(), v.clone()
        sinkgd_step([wk], [g * 2.0**k], lr=0.5, spectral_norm=spectral, spectral_vecs=[vk] if spectral else None)
        assert bool(torch.isfinite(wk).all()), f"non-finite W at a gradient scale of 2^{k}"
        deltas.append((wk - w).double().cpu())
    assert deltas[0].abs().max() > 1e-3
    for k, d in zip((80, 120), deltas[1:]):
        # W's own rounding (one fp32 ulp of |W| < 8) is the floor; a skipped step would miss by ~1e-2
        torch.testing.assert_close(d, deltas[0], rtol=1e-4, atol=8 * torch.finfo(torch.float32).eps,
                                   msg=lambda m: f"gradient scale 2^{k}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [48, 80])
@pytest.mark.parametrize("spectral", [False, True])
def test_gradients_near_the_fp32_maximum_give_the_normalized_step(device, n, spectral):
    """Entries up to the fp32 maximum (1e30, 3e38) give the float64 formula's step on every row
    pass: in the interpreter run rows of 48 take the one-read pass, rows of 80 the two-pass
    kernels (several 64-wide tiles per row); on the plain CPU run, the reference. A norm a * s
    (a the largest entry, s up to sqrt(n)) overflows there even scaled, and so does the power
    pass's G (c v) for a positive G and v (every term of a row's sum the same sign): each must
    be formed so that it stays finite, or the step comes out 0 (W unchanged) or NaN."""
    g0 = torch.Generator().manual_seed(11)
    w = torch.randn(2, 6, n, generator=g0)
    base = torch.rand(2, 6, n, generator=g0) + 0.25  # positive: the power pass's row sums add up
    base = base / base.amax()
    v = torch.rand(2, n, generator=g0) + 0.5
    v = v / v.norm(dim=1, keepdim=True)
    for top in (1e30, 3e38):
        g = (base.double() * top).float()
        assert bool(torch.isfinite(g).all()) and g.abs().max() > 0.99 * top
        ref_w, ref_v = ref_sinkgd(w, g, 0.5, iters=3, spectral=spectral, v=v)
        wd_, vd = w.clone().to(device), v.clone().to(device)
        sinkgd_step([wd_], [g.to(device)], lr=0.5, sinkhorn_iters=3, spectral_norm=spectral,
                    spectral_vecs=[vd] if spectral else None)
        assert bool(torch.isfinite(wd_).all()), f"entries up to {top:g}: a non-finite W"
        _assert_update_close(wd_, ref_w, w, torch.float32, f"entries up to {top:g}: ")
        if spectral:
            torch.testing.assert_close(vd.cpu().double(), ref_v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spectral", [False, True])
def test_float64_step_is_float64(device, spectral):
    """A float64 parameter is stepped in float64: lr=0 leaves it bitwise unchanged (it moved by
    about 1e-7 when the step was rounded through float32), and a step matches the float64 formula
    to float64 accuracy."""
    g0 = torch.Generator().manual_seed(8)
    w = torch.randn(3, 16, 12, generator=g0, dtype=torch.float64).to(device)
    g = torch.randn(3, 16, 12, generator=g0, dtype=torch.float64).to(device)
    v = torch.randn(3, 12, generator=g0).to(device)
    w0 = w.clone()
    sinkgd_step([w], [g], lr=0.0, spectral_norm=spectral, spectral_vecs=[v.clone()] if spectral else None)
    assert torch.equal(w, w0)
    # 0.1 is not a float32: a float lr is taken in float64 for a float64 step (it was rounded to
    # float32 once, a relative error of 1.5e-8 in the step)
    for lr in (0.25, 0.1, torch.tensor(0.1, dtype=torch.float64)):
        w = w0.clone()
        vv = v.clone()
        sinkgd_step([w], [g], lr=lr, spectral_norm=spectral, spectral_vecs=[vv] if spectral else None)
        ref, _ = ref_sinkgd(w0.cpu(), g.cpu(), float(lr), spectral=spectral, v=v.cpu())
        torch.testing.assert_close(w.cpu(), ref, rtol=0, atol=1e-13, msg=lambda m: f"lr {lr!r}: {m}")
    # and through the optimizer, whose float lr reaches the step the same way
    from torch_fused.optim.sinkgd import _warm_start

    p = torch.nn.Parameter(w0[0].clone())
    p.grad = g[0].clone()
    v0 = _warm_start(p).cpu()
    SinkGD([p], lr=0.1, spectral_norm=spectral).step()
    ref, _ = ref_sinkgd(w0[0].cpu(), g[0].cpu(), 0.1, spectral=spectral, v=v0)
    torch.testing.assert_close(p.detach().cpu(), ref, rtol=0, atol=1e-13)


def test_vectors_at_sinkgds_lr_warn():
    """SinkGD's lr is several times an AdamW lr: parameters with fewer than 2 dims sent to AdamW
    at that lr warn, naming the way out, and so does a use_fallback group (sinkgd_param_groups
    without an lr) that would train the embeddings and head at it; an explicit AdamW lr does not."""
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2, bias=False))
    with pytest.warns(UserWarning, match=r"3 parameter\(s\) with fewer than 2 dims .* lr=0\.01.*fallback_kwargs"):
        SinkGD(model.parameters(), lr=1e-2)
    lm = torch.nn.ModuleDict(dict(embed=torch.nn.Embedding(10, 8), body=torch.nn.Linear(8, 8, bias=False)))
    with pytest.warns(UserWarning, match=r"use_fallback group \(1 parameter\(s\).* lr=2\.0.*sinkgd_param_groups"):
        SinkGD(sinkgd_param_groups(lm), lr=2.0, spectral_norm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SinkGD(sinkgd_param_groups(lm, lr=1e-3), lr=2.0, spectral_norm=True)
        SinkGD(sinkgd_param_groups(lm), lr=2.0, fallback_kwargs={"lr": 1e-3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SinkGD(model.parameters(), lr=1e-2, fallback_kwargs={"lr": 1e-3})
        SinkGD(sinkgd_param_groups(model, lr=1e-3), lr=1e-2)
        SinkGD([p for p in model.parameters() if p.dim() == 2], lr=1e-2)


def test_stochastic_round_where_it_cannot_apply_warns():
    """stochastic_round=True on bf16 matrices on a device without the Triton kernels (the CPU
    outside the interpreter) rounds to nearest, as documented: the optimizer says so once, at
    construction, instead of training silently without it; fp32 matrices, a Triton device and
    the flag off do not warn."""
    import warnings

    from torch_fused._library import TRITON_DEVICES

    bf = torch.nn.Parameter(torch.randn(4, 8).bfloat16())
    fp = torch.nn.Parameter(torch.randn(4, 8))
    if "cpu" in TRITON_DEVICES:  # the interpreter run: the CPU takes the kernels, which round stochastically
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            SinkGD([bf], lr=0.1, stochastic_round=True)
        return
    with pytest.warns(UserWarning, match=r"stochastic_round=True has no effect on bf16 parameters on cpu"):
        SinkGD([bf, fp], lr=0.1, stochastic_round=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SinkGD([fp], lr=0.1, stochastic_round=True)
        SinkGD([bf], lr=0.1)
