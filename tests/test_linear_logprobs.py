"""fused::linear_logprobs_and_entropy, the fused lm_head: values and gradients against the
materialized float64 path, chunking (tokens forward, vocabulary backward), shift, bias,
temperature, logit_scale, softcap, ignore_index, opcheck, torch.compile and input errors.

Runs on the CPU reference path, under TRITON_INTERPRET=1 through the real kernels, and on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fused
from torch.utils._python_dispatch import TorchDispatchMode

from torch_fused._library import INTERPRET
from torch_fused.meta.linear_logprobs import HeadOptions
from torch_fused.settings import override
from _helpers import DEVICES, SMALL, assert_logprob_close, ref_linear

# norm-wise relative error of the gradients: the GEMMs accumulate in fp32 and round once to the
# inputs' dtype (d logits too, on devices where the GEMMs read them in that dtype)
GRAD_REL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 4e-6, torch.float64: 1e-10}


@pytest.fixture(autouse=True, scope="module")
def small_chunks():
    """Chunk buffers of a few columns, so small shapes take several ragged chunks (vocabulary
    chunks of ~1000 // N columns); GEMM tiles of 16 (ragged V, and H = 24 takes a masked K
    step), and forward launches of 16 rows (lm_head_part_bytes), on the fused-GEMM path."""
    with override(lm_head_chunk_bytes={"cpu": 4 * 1000, "cuda": 4 * 1000}, lm_head_min_cols={},
                  lm_head_dlogits_min_cols={}, lm_head_part_bytes=4000,
                  lm_head_tiles=dict.fromkeys(("stats", "dlogits", "stats_tma", "dlogits_tma"), (16, 16, 16, 2, 1, 2))):
        yield


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def cases(draw):
    return dict(
        dtype=draw(st.sampled_from(DTYPES)),
        v=draw(st.sampled_from([1, 7, 131, 300] if SMALL else [1, 7, 131, 300, 1031])),
        h=draw(st.sampled_from([8, 24])),
        b=draw(st.integers(1, 2)),
        l=draw(st.integers(1, 5 if SMALL else 9)),
        k=draw(st.sampled_from([None, 2, 5])),
        shift=draw(st.booleans()),
        bias=draw(st.booleans()),
        t=draw(st.sampled_from([1.0, 0.7])),
        scale=draw(st.sampled_from([1.0, 0.5])),
        softcap=draw(st.sampled_from([None, None, 4.0])),
        ignore=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        # K ids inside the fused GEMM epilogues (8) or beside them (1: the side kernel)
        epilogue_ids=draw(st.sampled_from([1, 8])),
    )


@pytest.fixture(params=["fused-gemm", "cublas-chunks"] + (["fused-gemm-pointer-loads"] if torch.cuda.is_available() else []),
                scope="module")
def gemm_path(request):
    """Each way of making the logits on the Triton path: inside the kernels (kernels/lm_head.py;
    on a GPU with TMA, also their pointer-load versions) and as fp32 GEMM chunks
    (the lm_head_fused_gemm setting)."""
    with override(lm_head_fused_gemm=frozenset() if request.param == "cublas-chunks" else frozenset({"forward", "backward"}),
                  lm_head_tma=request.param != "fused-gemm-pointer-loads"):
        yield request.param


@pytest.mark.parametrize("device", DEVICES)
@given(c=cases())
def test_matches_materialized_float64(device, gemm_path, c):
    gen = torch.Generator().manual_seed(c["seed"])
    dtype, v, hdim = c["dtype"], c["v"], c["h"]
    lead = (c["b"], c["l"] + c["shift"])
    h = torch.randn(*lead, hdim, generator=gen).to(device, dtype).requires_grad_(True)
    w = (torch.randn(v, hdim, generator=gen) / hdim**0.5 * 3).to(device, dtype).requires_grad_(True)
    bias = (torch.randn(v, generator=gen)).to(device, dtype).requires_grad_(True) if c["bias"] else None
    ishape = (c["b"], c["l"]) + ((c["k"],) if c["k"] else ())
    idx = torch.randint(0, v, ishape, generator=gen)
    if c["ignore"]:
        idx[0, 0] = -100
    idx = idx.to(device)
    kw = dict(temperature=c["t"], shift=c["shift"], logit_scale=c["scale"], softcap=c["softcap"])
    with override(lm_head_epilogue_ids=c["epilogue_ids"]):
        lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, bias=bias, **kw)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert lp.dtype == want and ent.dtype == want and lp.shape == idx.shape and ent.shape == (c["b"], c["l"])
    hr = h.detach().cpu().double().requires_grad_(True)
    wr = w.detach().cpu().double().requires_grad_(True)
    br = bias.detach().cpu().double().requires_grad_(True) if bias is not None else None
    rlp, rent = ref_linear(hr, wr, idx.cpu(), br, c["t"], c["scale"], c["softcap"], c["shift"])
    # the logits are fp32 GEMM results of the rounded inputs: fp32 accuracy, as the logits ops
    assert_logprob_close(lp, rlp, v, "logp", torch.float64 if dtype == torch.float64 else torch.float32)
    assert_logprob_close(ent, rent, v, "entropy", torch.float64 if dtype == torch.float64 else torch.float32)
    assert bool((lp.cpu()[idx.cpu() == -100] == 0).all())

    g1 = torch.randn(ishape, generator=gen, dtype=torch.float64)
    g2 = torch.randn(c["b"], c["l"], generator=gen, dtype=torch.float64)
    ins = [h, w] + ([bias] if bias is not None else [])
    grads = torch.autograd.grad((lp.double().cpu() * g1).sum() + (ent.double().cpu() * g2).sum(), ins)
    rins = [hr, wr] + ([br] if br is not None else [])
    rgrads = torch.autograd.grad((rlp * g1).sum() + (rent * g2).sum(), rins)
    # floor: fp32 rounding of d logits relative to the upstream gradients (V = 1: the true d
    # logits is exactly 0, fp32 gives p - 1 ~ 1e-7), carried through the GEMM with the other operand
    g_scale = (g1.norm() + g2.norm()).item() / c["t"] * c["scale"]
    other = {"d hidden": wr.norm().item(), "d weight": hr.norm().item(), "d bias": 1.0}
    for name, gr, rg, x in zip(("d hidden", "d weight", "d bias"), grads, rgrads, ins):
        assert gr.dtype == x.dtype and gr.shape == x.shape, name
        gr = gr.cpu().double()
        err = (gr - rg).norm().item()
        floor = (1e-12 if dtype == torch.float64 else 1e-6) * g_scale * other[name]
        assert err <= GRAD_REL[dtype] * rg.norm().item() + floor, (name, err, rg.norm().item(), floor)
    if c["shift"]:
        assert bool((grads[0][:, -1] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_ignored_positions_get_no_logprob_gradient(device):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, 8, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(50, 8, generator=gen).to(device).requires_grad_(True)
    idx = torch.randint(0, 50, (2, 5), generator=gen).to(device)
    idx[1] = -100
    lp, _ = torch_fused.linear_logprobs_and_entropy(h, w, idx)
    assert bool((lp[1] == 0).all())
    (dh,) = torch.autograd.grad(lp.sum(), h)
    assert bool((dh[1] == 0).all()) and bool((dh[0] != 0).any())


@pytest.mark.parametrize("device", DEVICES)
def test_one_chunk_equals_many(device, monkeypatch):
    """The shipped chunk sizes (one chunk at this size) and tiny ones give the same numbers."""
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(3, 7, 16, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(203, 16, generator=gen).to(device).requires_grad_(True)
    idx = torch.randint(0, 203, (3, 6), generator=gen).to(device)
    outs = []
    for budget in (4 * 1000, 1 << 24):
        with override(lm_head_chunk_bytes={"cpu": budget, "cuda": budget}):
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, shift=True)
            outs.append((lp, ent) + torch.autograd.grad(lp.sum() + ent.sum(), (h, w)))
    for a, b in zip(*outs):  # fp32 sums in another order: d hidden adds the chunks' GEMMs
        assert (a - b).norm().item() <= 2e-6 * b.norm().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_frozen_input_skips_its_gradient(device, frozen, gemm_path):
    """A frozen head (LoRA) or a detached input: the gradient autograd does not ask for is not
    computed (the backward op returns an empty tensor in its place), and the other one equals
    the gradient of the full backward."""
    gen = torch.Generator().manual_seed(6)
    dtype = torch.bfloat16 if device == "cuda" or INTERPRET else torch.float32
    v = 100 if INTERPRET else 300  # (what it checks is host logic; the kernels: the float64 tests)
    h = torch.randn(2, 6, 16, generator=gen).to(device, dtype)
    w = torch.randn(v, 16, generator=gen).to(device, dtype)
    idx = torch.randint(0, v, (2, 5), generator=gen).to(device)
    hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = torch_fused.linear_logprobs_and_entropy(hf, wf, idx, shift=True)
    full = dict(zip(("hidden", "weight"), torch.autograd.grad(lp.sum() + 0.5 * ent.sum(), (hf, wf))))
    hp, wp = h.clone().requires_grad_(frozen != "hidden"), w.clone().requires_grad_(frozen != "weight")
    lp, ent = torch_fused.linear_logprobs_and_entropy(hp, wp, idx, shift=True)
    live = "hidden" if frozen == "weight" else "weight"
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.fused._linear_logprobs_entropy_backward.default:
                seen.append([t.numel() for t in out[:2]])
            return out

    with Record():
        (g,) = torch.autograd.grad(lp.sum() + 0.5 * ent.sum(), hp if live == "hidden" else wp)
    assert torch.equal(g, full[live])
    assert len(seen) == 1 and seen[0][0 if frozen == "hidden" else 1] == 0, seen  # its GEMMs were skipped
    opts = HeadOptions(shift=True).values()
    stats = torch.ops.fused._linear_logprobs_entropy_forward(h, w, idx, None, *opts)[2]
    args = (torch.ones(2, 5, device=device), None, h, w, idx, None, stats, stats[..., 0], *opts)
    outs = torch.ops.fused._linear_logprobs_entropy_backward(*args, hidden_grad=frozen != "hidden",
                                                             weight_grad=frozen != "weight")
    both = torch.ops.fused._linear_logprobs_entropy_backward(*args)
    k = 1 if frozen == "hidden" else 0
    assert outs[1 - k].numel() == 0
    # the live gradient of the direct call equals the one the full backward computes
    assert outs[k].abs().sum() > 0
    torch.testing.assert_close(outs[k], both[k], rtol=8e-3, atol=1e-6)  # at most one bf16 rounding apart


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32,) if SMALL else (torch.float32, torch.bfloat16):
        h = torch.randn(2, 4, 8, generator=gen).to(device, dtype).requires_grad_(True)
        w = torch.randn(37, 8, generator=gen).to(device, dtype).requires_grad_(True)
        b = torch.randn(37, generator=gen).to(device, dtype).requires_grad_(True)
        idx = torch.randint(0, 37, (2, 3), generator=gen).to(device)
        torch.library.opcheck(torch.ops.fused.linear_logprobs_and_entropy, (h, w, idx),
                              {"bias": b, "shift": True, "temperature": 0.8})
        torch.library.opcheck(torch.ops.fused._linear_logprobs_entropy_forward,
                              (h, w, idx, None, *HeadOptions(shift=True, logit_scale=2.0, softcap=5.0).values()))


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 11, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(
        lambda a, c, d: torch_fused.linear_logprobs_and_entropy(a, c, idx, bias=d, shift=True, softcap=3.0,
                                                                logit_scale=1.5, temperature=0.9), (h, w, b))


def test_compile_fullgraph_dynamic_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager" if INTERPRET else "inductor")
    w = torch.randn(40, 8, requires_grad=True)

    def loss_fn(h, idx):
        lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, shift=True)
        return -lp.mean() - 0.01 * ent.mean()

    step = torch.compile(loss_fn, fullgraph=True, dynamic=True, backend=cnt)
    frames = []
    for length in (3, 5, 9) if SMALL else (5, 9, 17):
        g = torch.Generator().manual_seed(length)
        h = torch.randn(2, length + 1, 8, generator=g, requires_grad=True)
        idx = torch.randint(0, 40, (2, length), generator=g)
        loss = step(h, idx)
        dh, dw = torch.autograd.grad(loss, (h, w))
        ref = loss_fn(h, idx)
        rdh, rdw = torch.autograd.grad(ref, (h, w))
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(dh, rdh)
        torch.testing.assert_close(dw, rdw)
        frames.append(cnt.frame_count)
    # (the first call may trace twice: Dynamo restarts once to specialize the float defaults)
    assert frames[0] == frames[-1], f"recompiled across sequence lengths: frames {frames}"


BAD = [
    ("float index", lambda: (torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2)), {},
     r"index: expected dtype int32 or int64, got torch.float32"),
    ("hidden size", lambda: (torch.randn(2, 8), torch.randn(5, 7), torch.zeros(2, dtype=torch.long)), {},
     r"weight: hidden size 7 .* differs from hidden's last dim 8"),
    ("weight dtype", lambda: (torch.randn(2, 8), torch.randn(5, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.long)),
     {}, r"weight: expected the hidden states' dtype torch.float32, got torch.float64"),
    ("bias shape", lambda: (torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2, dtype=torch.long)),
     {"bias": torch.randn(4)}, r"bias: expected shape \(5,\)"),
    ("index shape", lambda: (torch.randn(2, 3, 8), torch.randn(5, 8), torch.zeros(2, 4, dtype=torch.long)), {},
     r"index: expected shape \(2, 3\)"),
    ("shift lengths", lambda: (torch.randn(2, 3, 8), torch.randn(5, 8), torch.zeros(2, 3, dtype=torch.long)),
     {"shift": True}, r"index: with shift=True, hidden .*\(2, 3, 8\).*\(2, 3\)"),
    ("softcap", lambda: (torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2, dtype=torch.long)), {"softcap": 0.0},
     r"softcap: expected None or a positive finite number, got 0.0"),
    ("temperature", lambda: (torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2, dtype=torch.long)),
     {"temperature": float("inf")}, r"temperature: expected a positive finite number, got inf"),
    ("tensor temperature", lambda: (torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2, dtype=torch.long)),
     {"temperature": torch.tensor(0.7, requires_grad=True)}, r"temperature: .* takes a float temperature"),
    ("hidden size 0", lambda: (torch.randn(2, 0), torch.randn(5, 0), torch.zeros(2, dtype=torch.long)), {},
     r"weight: the hidden size \(dim 1\) must be >= 1"),
    ("logit_scale None", lambda: (torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2, dtype=torch.long)),
     {"logit_scale": None}, r"logit_scale: expected a number, got None"),
    ("softcap bool", lambda: (torch.randn(2, 8), torch.randn(5, 8), torch.zeros(2, dtype=torch.long)),
     {"softcap": True}, r"softcap: expected a number or None, got True"),
]


@pytest.mark.parametrize("name,make,kw,msg", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bad_input_clear_error(name, make, kw, msg, mode):
    h, w, idx = make()

    def f(a, b, c):
        return torch_fused.linear_logprobs_and_entropy(a, b, c, **kw)

    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=msg):
        f(h, w, idx)


@pytest.mark.skipif(INTERPRET, reason="checked on the plain CPU path (the check reads the index on CPU)")
def test_index_out_of_range_cpu():
    with pytest.raises(IndexError, match=r"index: value 5 is outside \[0, V=5\)"):
        torch_fused.linear_logprobs_and_entropy(torch.randn(2, 8), torch.randn(5, 8), torch.tensor([1, 5]))


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer-loads"])
@pytest.mark.parametrize("device", DEVICES)
def test_temperature_past_the_fma_shift(device, tma, settings_override):
    """A temperature whose scale log2(e) / T passes FMA_SHIFT_MAX_C (T below 0.0014): the kernels
    shift exactly (EXACT_SHIFT), which is not the interpreter's upcast dot; on a GPU the fused
    GEMM kernels (TMA, and the pointer-load ones of GPUs without TMA) compile and match float64."""
    settings_override(lm_head_fused_gemm=frozenset({"forward", "backward"}), lm_head_tma=tma)
    gen = torch.Generator().manual_seed(31)
    h = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    w = (torch.randn(300, 64, generator=gen) / 4096).to(torch.bfloat16)  # logits / T of a few tens
    idx = torch.randint(0, 300, (6,), generator=gen)
    t = 1e-3
    hd, wd = h.to(device).requires_grad_(True), w.to(device).requires_grad_(True)
    lp, ent = torch_fused.linear_logprobs_and_entropy(hd, wd, idx.to(device), temperature=t)
    rlp, _ = ref_linear(h, w, idx, None, t)
    assert_logprob_close(lp, rlp, 300, "logp, T = 1e-3")
    z = torch.log_softmax((h.double() @ w.double().t()) / t, -1)
    rent = -torch.where(z.exp() > 0, z.exp() * z, torch.zeros_like(z)).sum(-1)
    assert_logprob_close(ent, rent, 300, "entropy, T = 1e-3")
    gh, gw = torch.autograd.grad(lp.sum() + ent.sum(), (hd, wd))
    h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
    z = torch.log_softmax((h64 @ w64.t()) / t, -1)
    loss = z.gather(-1, idx[:, None]).sum() - (z.exp() * z).sum()
    for got, want, name in zip((gh, gw), torch.autograd.grad(loss, (h64, w64)), ("d hidden", "d weight")):
        rel = (got.double().cpu() - want).norm() / want.norm()
        assert rel.item() <= 1e-2, f"{name}: relative error {rel.item():.3g}"


@pytest.mark.parametrize("device", DEVICES)
def test_edge_cases_across_chunks(device, settings_override):
    """Empty inputs with K ids; a vocabulary chunk whose logits are all -inf for a row (its
    placeholder max must not enter the merge); logits near 1e4 over several chunks (the shifts
    of the chunks' sums must be differenced as the sums were made)."""
    settings_override(lm_head_chunk_bytes={"cpu": 4 * 128 * 2, "cuda": 4 * 128 * 2})  # 128-column chunks, 2 rows
    lp, ent = torch_fused.linear_logprobs_and_entropy(torch.randn(0, 8, device=device), torch.randn(5, 8, device=device),
                                                      torch.zeros(0, 3, dtype=torch.long, device=device))
    assert lp.shape == (0, 3) and ent.shape == (0,)
    lp, ent = torch_fused.linear_logprobs_and_entropy(torch.randn(2, 1, 8, device=device), torch.randn(5, 8, device=device),
                                                      torch.zeros(2, 0, 2, dtype=torch.long, device=device), shift=True)
    assert lp.shape == (2, 0, 2) and ent.shape == (2, 0)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 8, generator=gen)
    w = torch.randn(256, 8, generator=gen)
    b = torch.full((256,), -20.0)
    b[:128] = float("-inf")
    idx = torch.tensor([200, 150])
    for t in (1.0, 0.1):
        lp, ent = torch_fused.linear_logprobs_and_entropy(h.to(device), w.to(device), idx.to(device), bias=b.to(device),
                                                          temperature=t)
        rlp, _ = ref_linear(h, w, idx, b, t)
        assert_logprob_close(lp, rlp, 256, f"logp, -inf chunk, T={t}")
        z = torch.log_softmax((h.double() @ w.double().t() + b.double()) / t, -1)
        rent = -torch.where(z.exp() > 0, z.exp() * z, torch.zeros_like(z)).sum(-1)
        assert_logprob_close(ent, rent, 256, f"entropy, -inf chunk, T={t}")
    h = torch.ones(2, 1)
    w = (1e4 + torch.randn(300, 1, generator=gen)).float()
    idx = torch.tensor([0, 5])
    lp, _ = torch_fused.linear_logprobs_and_entropy(h.to(device), w.to(device), idx.to(device))
    rlp, _ = ref_linear(h, w, idx)
    assert (lp.double().cpu() - rlp).abs().max().item() <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [None, 2])
def test_out_of_range_id_stays_in_its_row(device, k, gemm_path):
    """On the kernel path an id outside [0, V) (not checked: a device sync) gives NaN at its
    position and a NaN row of d hidden, as the logits ops do, and nothing else: d weight and d
    bias are those of the same call with the id ignored, every other d hidden row too."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the plain CPU path raises IndexError (test_index_out_of_range_cpu)")
    g = torch.Generator().manual_seed(4)
    n, hdim, v = 6, 16, 40
    # bf16: the fused-GEMM kernels' path as well as the chunks'
    h = torch.randn(n, hdim, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(v, hdim, generator=g) / 4).to(device, torch.bfloat16)
    b = torch.randn(v, generator=g).to(device, torch.bfloat16)
    shape = (n,) if k is None else (n, k)
    idx = torch.randint(0, v, shape, generator=g).to(device)
    bad = idx.clone()
    bad[2] = v + 3 if k is None else torch.tensor([1, -7])  # row 2: out of range (one of its ids)
    ignored = idx.clone()
    ignored[2] = -100 if k is None else torch.tensor([1, -100])
    gl = torch.randn(shape, generator=g).to(device)
    ge = torch.randn(n, generator=g).to(device)

    def run(ids):
        hh, ww, bb = (t.clone().requires_grad_(True) for t in (h, w, b))
        lp, ent = torch_fused.linear_logprobs_and_entropy(hh, ww, ids, bias=bb)
        return (lp, ent) + torch.autograd.grad(((lp.nan_to_num() * gl).sum() + (ent * ge).sum()), (hh, ww, bb))

    lp, ent, dh, dw, db = run(bad)
    lp0, ent0, dh0, dw0, db0 = run(ignored)
    assert torch.isnan(lp[2]).any() and not torch.isnan(lp[torch.arange(n) != 2]).any()
    assert torch.isfinite(dw).all() and torch.isfinite(db).all()
    assert torch.isnan(dh[2]).all() and torch.isfinite(dh[torch.arange(n) != 2]).all()
    torch.testing.assert_close(dw, dw0)
    torch.testing.assert_close(db, db0)
    torch.testing.assert_close(dh[torch.arange(n) != 2], dh0[torch.arange(n) != 2])
    torch.testing.assert_close(ent, ent0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("epilogue_ids", [1, 8])
def test_ids_on_every_column_of_the_tiles(device, epilogue_ids, settings_override):
    """K ids per row that together name every vocabulary column once, so that some row's id sits
    on the first and the last column of every column tile whatever the tiles' width (the fused
    epilogues skip an id's work in tiles that do not hold it), and on the first and last column of
    every d logits chunk (the side kernel's ids, epilogue_ids 1, written into each chunk):
    log-probs and the gradients of hidden and weight against float64."""
    settings_override(lm_head_epilogue_ids=epilogue_ids, lm_head_dlogits_min_cols={},
                      lm_head_chunk_bytes={"cpu": 2 * 50 * 64, "cuda": 2 * 50 * 64})  # 64-column bf16 chunks
    g = torch.Generator().manual_seed(8)
    n, k, hdim = 50, 6, 8
    v = n * k  # 300: past a 256-column tile
    h = torch.randn(n, hdim, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(v, hdim, generator=g) / 2).to(device, torch.bfloat16)
    idx = torch.randperm(v, generator=g).reshape(n, k).to(device)
    gl = torch.randn(n, k, generator=g, dtype=torch.float64)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with override(lm_head_fused_gemm=frozenset({"forward", "backward"})):  # the epilogues' path
        lp, _ = torch_fused.linear_logprobs_and_entropy(hh, ww, idx)
        dh, dw = torch.autograd.grad((lp * gl.to(device).float()).sum(), (hh, ww))
    h64, w64 = (t.detach().double().cpu().requires_grad_(True) for t in (h, w))
    lr = torch.log_softmax(h64 @ w64.T, -1).gather(1, idx.cpu())
    dh64, dw64 = torch.autograd.grad((lr * gl).sum(), (h64, w64))
    torch.testing.assert_close(lp.double().cpu(), lr.detach(), rtol=0, atol=2e-5)
    # bf16 gradients from bf16 d logits: each row within 1% of its norm (an id's term left out
    # is about the size of the whole row)
    for name, a, e in (("hidden", dh, dh64), ("weight", dw, dw64)):
        err = (a.double().cpu() - e).norm(dim=1) / e.norm(dim=1)
        assert err.max().item() < 1e-2, (name, err.max().item(), int(err.argmax()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("epilogue_ids", [1, 8])
@pytest.mark.parametrize("invariant", [False, True])
def test_repeated_and_ignored_ids_against_float64(device, epilogue_ids, invariant, settings_override):
    """K ids per row with an id repeated (its d logit takes both slots' gradients), ignore_index
    slots, a bias and a temperature, through each route of the fused head's ids (the side kernel,
    epilogue_ids 1, and the epilogues) and with the batch-invariant setting on and off: log-probs,
    entropy and the gradients of hidden, weight and bias against float64."""
    settings_override(lm_head_epilogue_ids=epilogue_ids, lm_head_batch_invariant=invariant,
                      lm_head_fused_gemm=frozenset({"forward", "backward"}))  # the fused GEMMs' routes
    g = torch.Generator().manual_seed(12)
    n, k, hdim, v = 9, 5, 24, 70
    h = torch.randn(n, hdim, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(v, hdim, generator=g) / 2).to(device, torch.bfloat16)
    b = torch.randn(v, generator=g).to(device, torch.bfloat16)
    idx = torch.randint(0, v, (n, k), generator=g)
    idx[:, 3] = idx[:, 1]  # every row repeats an id
    idx[2, 0] = idx[5, 4] = -100
    gl = torch.randn(n, k, generator=g, dtype=torch.float64)
    ge = torch.randn(n, generator=g, dtype=torch.float64)
    hh, ww, bb = (t.clone().requires_grad_(True) for t in (h, w, b))
    lp, ent = torch_fused.linear_logprobs_and_entropy(hh, ww, idx.to(device), bias=bb, temperature=0.8)
    grads = torch.autograd.grad((lp * gl.to(device).float()).sum() + (ent * ge.to(device).float()).sum(), (hh, ww, bb))
    h64, w64, b64 = (t.detach().double().cpu().requires_grad_(True) for t in (h, w, b))
    lr, er = ref_linear(h64, w64, idx, b64, 0.8, 1.0, None, False)
    grads64 = torch.autograd.grad((lr * gl).sum() + (er * ge).sum(), (h64, w64, b64))
    torch.testing.assert_close(lp.double().cpu(), lr.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double().cpu(), er.detach(), rtol=0, atol=2e-5)
    assert bool((lp.cpu()[idx == -100] == 0).all())
    for name, a, e in zip(("hidden", "weight", "bias"), grads, grads64):
        err = (a.double().cpu() - e).norm() / e.norm()
        assert err.item() < 1e-2, (name, err.item())


@pytest.mark.parametrize("device", DEVICES)
def test_slice_backward_op_is_the_head_backward_on_a_vocabulary_slice(device):
    """fused::_linear_logprobs_slice_backward (the vocabulary-parallel head's local backward, one
    opaque op under torch.compile): the slices' d hidden rows sum to the whole head's d hidden, and
    each slice's d weight / d bias are the whole one's rows; opcheck on it."""
    gen = torch.Generator().manual_seed(8)
    v, hd = 37, 8
    h = torch.randn(2, 4, hd, generator=gen).to(device)
    w = torch.randn(v, hd, generator=gen).to(device)
    b = torch.randn(v, generator=gen).to(device)
    idx = torch.randint(0, v, (2, 3), generator=gen).to(device)
    opts = HeadOptions(shift=True, temperature=0.8)
    lp, ent, stats = torch.ops.fused._linear_logprobs_entropy_forward(h, w, idx, b, *opts.values())
    gl, ge = torch.randn(lp.shape, generator=gen).to(device), torch.randn(ent.shape, generator=gen).to(device)
    dh, dw, db = torch.ops.fused._linear_logprobs_entropy_backward(gl, ge, h, w, idx, b, stats, ent, *opts.values())
    dh_rows = torch.zeros(6, hd, device=device)
    for lo, hi in ((0, 15), (15, 37)):
        args = (gl, ge, h, w[lo:hi], idx, b[lo:hi], stats, ent, *opts.values())
        kw = dict(v_off=lo, v_total=v)
        part_h, part_w, part_b = torch.ops.fused._linear_logprobs_slice_backward(*args, **kw)
        assert part_h.shape == (6, hd) and part_h.dtype == torch.float32
        dh_rows += part_h
        # the slice's logits come from their own GEMM launch: an element may sit elsewhere in its
        # tile, which moves its rounding on CPU (BLAS) by an ulp; fp32 rounding, norm-wise
        for part, whole in ((part_w, dw[lo:hi]), (part_b, db[lo:hi])):
            assert (part - whole).norm() <= 2e-6 * whole.norm()
        torch.library.opcheck(torch.ops.fused._linear_logprobs_slice_backward, args, kw)
    torch.testing.assert_close(dh_rows.view(2, 3, hd), dh[:, :-1], rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("n,hd,v", [(1024, 4096, 151936), (4096, 2048, 32000)])
def test_bf16_head_error_within_twice_an_fp32_head(n, hd, v, settings_override):
    """bf16 hidden states and weight: the fused head's log-probs and entropy are within 2x the
    error of an fp32 head on the same inputs (fp32 GEMM, no TF32, then log_softmax), both against
    float64. The bf16 GEMM tiles add each K step's product to their fp32 sum with a rounded add
    (the lm_head_promote setting); accumulated inside the tensor-core instructions, the error was
    about 5x the fp32 head's."""
    settings_override(lm_head_promote=True)
    gen = torch.Generator().manual_seed(21)
    h = torch.randn(n, hd, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(v, hd, generator=gen) * hd ** -0.5 * 4).to(torch.bfloat16).cuda()
    idx = torch.randint(0, v, (n,), generator=gen).cuda()
    lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        errs = {}
        for name, dt in (("fp32", torch.float32), ("f64", torch.float64)):
            errs[name] = []
            w_dt = w.to(dt)
            for r0 in range(0, n, 512):  # rows at a time: float64 logits of every row would take 5 GB
                z = torch.log_softmax(h[r0:r0 + 512].to(dt) @ w_dt.t(), -1)
                errs[name].append((z.gather(1, idx[r0:r0 + 512, None])[:, 0].double(),
                                   -(z.exp() * z).sum(-1).double()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    lp32, ent32 = (torch.cat([e[j] for e in errs["fp32"]]) for j in range(2))
    lp64, ent64 = (torch.cat([e[j] for e in errs["f64"]]) for j in range(2))
    err_fused = (lp.double() - lp64).abs().max().item()
    err_fp32 = (lp32 - lp64).abs().max().item()
    assert err_fused <= 2 * err_fp32, (err_fused, err_fp32)
    e_fused = (ent.double() - ent64).abs().max().item()
    e_fp32 = (ent32 - ent64).abs().max().item()
    assert e_fused <= 2 * max(e_fp32, 1e-6), (e_fused, e_fp32)
