"""CUDA-only cases: 64-bit offsets (rows * V > 2**31) and the compiled training step."""

from __future__ import annotations

import pytest
import torch

import torch_fused
from _helpers import assert_grad_close, assert_logprob_close, ref_logprobs_entropy, rel_err

pytestmark = pytest.mark.cuda


def test_rows_times_vocab_above_2_pow_31():
    v = 151936
    rows = 2**31 // v + 64  # 14198 rows: the last rows start past element 2**31
    full = torch.randn(2, rows // 2 + 1, v, device="cuda", dtype=torch.bfloat16) * 3
    x = full[:, :-1]  # strided view: the outer stride times the batch index passes 2**31 too
    assert x.numel() > 2**31
    idx = torch.randint(0, v, x.shape[:-1], device="cuda")
    xg = x.detach().requires_grad_(True)
    lp, ent = torch_fused.logprobs_and_entropy(xg, idx)
    g = torch.randn_like(ent)
    (dx,) = torch.autograd.grad((lp * g).sum() + (ent * g).sum(), xg)
    # check the rows at both ends of the tensor (and so past the 2**31 element offset)
    for b, sl in [(0, slice(0, 4)), (1, slice(-4, None))]:
        xr = x[b, sl].detach().cpu().double().requires_grad_(True)
        rlp, rent = ref_logprobs_entropy(xr, idx[b, sl].cpu(), 1.0)
        assert_logprob_close(lp[b, sl], rlp, v, "logp", torch.bfloat16)
        assert_logprob_close(ent[b, sl], rent, v, "entropy", torch.bfloat16)
        gr = g[b, sl].cpu().double()
        (rdx,) = torch.autograd.grad((rlp * gr).sum() + (rent * gr).sum(), xr)
        assert_grad_close(dx[b, sl], rdx, 2 * gr.abs()[..., None], torch.bfloat16, "d logits")


def test_compiled_pg_step_cuda():
    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 1000, device="cuda", dtype=torch.bfloat16)

    def loss_fn(h, index, adv):
        logits = lin(h)
        logp, ent = torch_fused.logprobs_and_entropy(logits[:, :-1], index)
        return -(adv[:, None] * logp).mean() - 0.01 * ent.mean()

    step = torch.compile(loss_fn, fullgraph=True, dynamic=True)
    for length in (17, 33):
        h = torch.randn(4, length + 1, 64, device="cuda", dtype=torch.bfloat16)
        index = torch.randint(0, 1000, (4, length), device="cuda")
        adv = torch.randn(4, device="cuda")
        loss = step(h, index, adv)
        loss.backward()
        gw = lin.weight.grad.clone()
        lin.weight.grad = None
        # the plain formula in float64 on the same bf16 logits: the loss to fp32 accuracy, d weight
        # within the one bf16 rounding of d logits (then an fp32-accumulated GEMM)
        logits = lin(h).detach().double().requires_grad_(True)
        lp = torch.log_softmax(logits[:, :-1], -1)
        ref = -(adv[:, None].double() * lp.gather(-1, index[..., None])[..., 0]).mean() \
            + 0.01 * (lp.exp() * lp).sum(-1).mean()
        (dlogits,) = torch.autograd.grad(ref, logits)
        ref_gw = torch.einsum("blv,blh->vh", dlogits, h.double())
        assert abs(loss.item() - ref.item()) <= 1e-5 * max(abs(ref.item()), 1.0), (loss.item(), ref.item())
        assert rel_err(gw.double(), ref_gw) < 8e-3, rel_err(gw.double(), ref_gw)
        lin.weight.grad = None


def test_compiled_pg_step_shift_cuda():
    """The model's call pattern on CUDA: shift=True on the head's [B, L+1, V] output, compiled."""
    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 1000, device="cuda", dtype=torch.bfloat16)

    def loss_fn(h, index, adv):
        logp, ent = torch_fused.logprobs_and_entropy(lin(h), index, shift=True)
        return -(adv[:, None] * logp).mean() - 0.01 * ent.mean()

    def loss_ref(h, index, adv):
        logp, ent = torch_fused.logprobs_and_entropy(lin(h)[:, :-1], index)
        return -(adv[:, None] * logp).mean() - 0.01 * ent.mean()

    step = torch.compile(loss_fn, fullgraph=True, dynamic=True)
    for length in (17, 33):
        h = torch.randn(4, length + 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        index = torch.randint(0, 1000, (4, length), device="cuda")
        adv = torch.randn(4, device="cuda")
        dh, dw = torch.autograd.grad(step(h, index, adv), (h, lin.weight))
        rdh, rdw = torch.autograd.grad(loss_ref(h, index, adv), (h, lin.weight))
        assert rel_err(dh, rdh) < 1e-2 and rel_err(dw, rdw) < 1e-2


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer-loads"])
def test_linear_logprobs_default_chunks_cuda(tma, settings_override):
    """The fused lm_head with the shipped tiles and chunk budget (several chunks), rows, columns
    and H all ragged against the tiles, TMA and pointer-load kernels, against the materialized
    float64 path."""
    from torch_fused.settings import current

    settings_override(lm_head_tma=tma)
    n, hd, v = 3000, 264, 50000
    assert n * v * 4 > current.lm_head_chunk_bytes["cuda"]  # several token chunks forward, vocabulary chunks backward
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hd, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hd, device="cuda", generator=g) / 8).to(torch.bfloat16).requires_grad_(True)
    idx = torch.randint(0, v, (n,), device="cuda", generator=g)
    idx[::7] = -100
    lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, temperature=0.9)
    hr = h.detach().double().requires_grad_(True)
    wr = w.detach().double().requires_grad_(True)
    z = torch.log_softmax((hr @ wr.t()) / 0.9, -1)
    rlp = torch.where(idx == -100, 0.0, z.gather(-1, idx.clamp_min(0)[:, None])[:, 0])
    rent = -(z.exp() * z).sum(-1)
    assert (lp.double() - rlp).abs().max().item() < 1e-3  # fp32 GEMM accumulation over H = 256
    assert (ent.double() - rent).abs().max().item() < 1e-3
    g1 = torch.randn(n, device="cuda", dtype=torch.float64, generator=g)
    dh, dw = torch.autograd.grad((lp.double() * g1).sum() + (ent.double() * g1).sum(), (h, w))
    rdh, rdw = torch.autograd.grad((rlp * g1).sum() + (rent * g1).sum(), (hr, wr))
    assert rel_err(dh, rdh) < 8e-3 and rel_err(dw, rdw) < 8e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_segmented_backward_shift_top_k_cuda(dtype):
    """The backward's row segments (the logprobs_bwd_segment setting) with the shipped settings:
    V = 40000 gives two segments, the last ragged against the block; shift=True (the zero rows
    come from the same launch), three ids per row, one of them ignore_index, ids on the first and
    last column and at the segment border, temperature 0.8; against float64."""
    from torch_fused.kernels import logprobs as K

    v, k, t = 40000, 3, 0.8
    segs, seg_len = K.backward_segments(v, K.pick_block(v, dtype.itemsize, "bwd")[0])
    assert segs == 2 and v % seg_len != 0
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(3, 6, v, device="cuda", generator=g) * 3).to(dtype).requires_grad_(True)
    idx = torch.randint(0, v, (3, 5, k), device="cuda", generator=g)
    idx[0, 0] = torch.tensor([0, v - 1, seg_len])
    idx[1, :, 2] = seg_len - 1
    idx[2, 1, 0] = -100
    lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t, shift=True)
    g_lp = torch.randn(lp.shape, device="cuda", generator=g)
    g_ent = torch.randn(ent.shape, device="cuda", generator=g)
    (dx,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), x)
    xr = x.detach().cpu().double().requires_grad_(True)
    rlp, rent = ref_logprobs_entropy(xr[:, :-1], idx.cpu(), t)
    assert_logprob_close(lp, rlp, v, "logp", dtype)
    assert_logprob_close(ent, rent, v, "entropy", dtype)
    gl, ge = g_lp.cpu().double(), g_ent.cpu().double()
    (rdx,) = torch.autograd.grad((rlp * gl).sum() + (rent * ge).sum(), xr)
    scale = torch.zeros(3, 6, 1, dtype=torch.float64)
    scale[:, :-1] = ((gl * (idx.cpu() != -100)).abs().sum(-1) + ge.abs())[..., None] / t
    assert (dx[:, -1] == 0).all()
    assert_grad_close(dx[:, :-1], rdx[:, :-1], scale[:, :-1], dtype, "d logits")


def _inline_case(name):
    """(function of (logits, *extra) -> loss, logits, extra tensors) of one compiled-launch case."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    def ids(shape, v):
        return torch.randint(0, v, shape, device="cuda", generator=g)

    if name == "grpo bf16 [64, 1024]":
        from torch_fused.bench.small import grpo_loss
        n, v = 64, 1024
        mask = (torch.rand(n, device="cuda", generator=g) > 0.2).float()
        loss = grpo_loss(torch_fused.logprobs_and_entropy)
        return (lambda x, i, o, a, m: loss(x, i, o, a, m)), randn(n, v, dtype=torch.bfloat16) * 3, \
            (ids((n,), v), randn(n) * 0.1 - 5, randn(n), mask)
    if name == "selective fp16 [4, 33, 1000], ignored ids":
        i = ids((4, 33), 1000)
        i[:, ::5] = -100
        return (lambda x, i, w: (torch_fused.selective_log_softmax(x, i) * w).sum()), \
            randn(4, 33, 1000, dtype=torch.float16), (i, randn(4, 33))
    if name == "entropy fp32 [512, 4096], T 0.7":
        return (lambda x, w: (torch_fused.entropy_from_logits(x, temperature=0.7) * w).sum()), \
            randn(512, 4096) * 2, (randn(512),)
    if name == "both bf16 [256, 5000], 3 ids per row":
        def f(x, i, w):
            lp, ent = torch_fused.logprobs_and_entropy(x, i)
            return (lp * w[:, None]).sum() + ent.mean()
        return f, randn(256, 5000, dtype=torch.bfloat16), (ids((256, 3), 5000), randn(256))
    if name == "both bf16, transposed logits":
        def f(xt, i, w):
            lp, ent = torch_fused.logprobs_and_entropy(xt.t(), i)
            return (lp * w).sum() - (ent * w).sum()
        return f, randn(3000, 96, dtype=torch.bfloat16), (ids((96,), 3000), randn(96))
    if name == "both bf16, logits of an in-graph matmul, V 50257":
        w_head = randn(50257, 64, dtype=torch.bfloat16) / 8

        def f(h, i, w):
            lp, ent = torch_fused.logprobs_and_entropy(h @ w_head.t(), i)
            return (lp * w).sum() + 0.01 * ent.sum()
        return f, randn(48, 64, dtype=torch.bfloat16), (ids((48,), 50257), randn(48))
    if name == "both bf16, tensor temperature":
        def f(x, t, i, w):
            lp, ent = torch_fused.logprobs_and_entropy(x, i, temperature=t)
            return (lp * w).sum() + (ent * w).sum()
        return f, randn(128, 2048, dtype=torch.bfloat16), \
            (torch.tensor(0.8, device="cuda", requires_grad=True), ids((128,), 2048), randn(128))
    if name == "both bf16, shift [4, 17, 3000]":
        def f(x, i, w):
            lp, ent = torch_fused.logprobs_and_entropy(x, i, shift=True)
            return (lp * w).sum() + 0.1 * ent.sum()
        return f, randn(4, 17, 3000, dtype=torch.bfloat16), (ids((4, 16), 3000), randn(4, 16))
    raise KeyError(name)


INLINE_CASES = ["grpo bf16 [64, 1024]", "selective fp16 [4, 33, 1000], ignored ids", "entropy fp32 [512, 4096], T 0.7",
                "both bf16 [256, 5000], 3 ids per row", "both bf16, transposed logits",
                "both bf16, logits of an in-graph matmul, V 50257", "both bf16, tensor temperature",
                "both bf16, shift [4, 17, 3000]"]


@pytest.fixture
def compile_caches_off():
    """No compiled graph from torch.compile's caches: they key a graph by what Dynamo traced, the
    same with and without settings.compile_inline_kernels. Where torch has
    ``torch.compiler.config.cache_key_tag`` the setting keys them apart (settings.py); without it,
    a graph compiled earlier with the other setting (another test, another process on this
    machine) would be reused. (config.patch: monkeypatch's undo deletes a config entry.)"""
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("name", INLINE_CASES)
def test_compiled_inline_launches_match_eager(name, settings_override, compile_caches_off):
    """settings.compile_inline_kernels: the compiled loss, whose log-prob kernel launches Inductor
    makes itself (static shapes), gives the eager call's loss and gradients: the same kernels, so
    to fp32 rounding of the surrounding arithmetic; every gradient finite (fresh outputs are
    NaN-filled in the tests: an output the traced launches never wrote shows)."""
    f, x, extra = _inline_case(name)
    x = x.requires_grad_(True)
    wrt = (x,) + tuple(t for t in extra if t.requires_grad)
    ref = f(x, *extra)
    ref_grads = torch.autograd.grad(ref, wrt)
    settings_override(compile_inline_kernels=True)
    torch._dynamo.reset()
    step = torch.compile(f, fullgraph=True, dynamic=False)
    for _ in range(2):  # the second call runs the compiled code only
        out = step(x, *extra)
        grads = torch.autograd.grad(out, wrt)
        for gr, rg in zip(grads, ref_grads):
            assert torch.isfinite(gr).all(), f"{int((~torch.isfinite(gr)).sum())} non-finite gradient elements"
            assert rel_err(gr, rg) < 1e-3, rel_err(gr, rg)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inline", [True, False], ids=["inlined", "opaque"])
def test_compiled_dynamic_sizes_launch_inline(inline, settings_override, compile_caches_off):
    """torch.compile's default (a static graph first, then, as the batch and sequence sizes change,
    one with those sizes symbolic; the vocabulary does not change and stays static): with
    settings.compile_inline_kernels the log-prob launches are in the compiled code of both (no
    call of the op's implementation at run time: the profiler sees no fused:: op); off, every call
    is an op call. Values as eager at each size."""
    from torch.profiler import ProfilerActivity, profile

    settings_override(compile_inline_kernels=inline)
    v = 3000

    def loss(x, i, w):
        lp, ent = torch_fused.logprobs_and_entropy(x, i)
        lp2 = torch_fused.selective_log_softmax(x, i, temperature=0.7)
        return (lp * w).sum() + (lp2 * w).sum() - 0.01 * ent.sum()

    torch._dynamo.reset()
    step = torch.compile(loss, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, length in [(2, 17), (3, 40), (5, 9)]:  # static; symbolic; the symbolic graph again
        x = (torch.randn(b, length, v, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
        i = torch.randint(0, v, (b, length), device="cuda", generator=g)
        i[:, ::4] = -100
        w = torch.randn(b, length, device="cuda", generator=g)
        ref = loss(x, i, w)
        (rdx,) = torch.autograd.grad(ref, x)
        torch.autograd.grad(step(x, i, w), x)  # compiles (the trace calls the ops on fake tensors)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = step(x, i, w)
            (dx,) = torch.autograd.grad(out, x)
        op_calls = [e.name for e in prof.events() if e.name.startswith("fused::")]
        assert (op_calls == []) if inline else op_calls, op_calls
        assert torch.isfinite(dx).all()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
        assert rel_err(dx, rdx) < 1e-3, rel_err(dx, rdx)


@pytest.mark.parametrize("case", ["plain", "ignored ids, K=3", "tensor temperature", "shift", "misaligned logits"])
def test_direct_launch_matches_kernel_grid(case, settings_override):
    """settings.direct_launch: the public functions' values and gradients are bit-identical to the
    kernel[grid] launches', on every call (the first, through kernel[grid], and the later ones,
    through the compiled kernel's launcher), including logits whose data pointer is not 16-byte
    aligned (their own compiled kernel)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(6, 9, 1001, device="cuda", dtype=torch.bfloat16, generator=g) * 4
    logits = base[..., 1:] if case == "misaligned logits" else base[..., :1000]
    k = 3 if case.startswith("ignored") else None
    shape = logits.shape[:-1] if case != "shift" else (6, 8)
    idx = torch.randint(0, 1000, shape + ((k,) if k else ()), device="cuda", generator=g)
    if k:
        idx[0, 0, 1] = -100
    temp = torch.tensor(0.7, device="cuda", requires_grad=True) if case == "tensor temperature" else 0.7

    def run():
        x = logits.detach().requires_grad_(True)
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=temp, shift=case == "shift")
        (lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    settings_override(direct_launch=False)
    want = run()
    settings_override(direct_launch=True)
    for _ in range(3):
        got = run()
        for a, b in zip(got, want):
            assert torch.equal(a, b) or torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _grpo_inputs(gen, n=64, v=1024):
    x = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(torch.bfloat16).requires_grad_(True)
    return (x, torch.randint(0, v, (n,), device="cuda", generator=gen),
            torch.randn(n, device="cuda", generator=gen) * 0.1 - 5, torch.randn(n, device="cuda", generator=gen),
            (torch.rand(n, device="cuda", generator=gen) > 0.2).float())


@pytest.mark.parametrize("inline", [True, False], ids=["inlined", "opaque"])
def test_compiled_under_cuda_graphs_matches_eager(inline, settings_override, compile_caches_off):
    """torch.compile(mode="reduce-overhead"): the GRPO loss's forward and backward run as
    Inductor's CUDA graphs (recorded, no skip), with the log-prob launches inlined into the graph
    or as op calls, and give the eager call's loss and d logits at every step, new inputs each
    step (copied into the graphs' input buffers at each replay)."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    from torch_fused.bench.small import grpo_loss

    settings_override(compile_inline_kernels=inline)
    loss = grpo_loss(torch_fused.logprobs_and_entropy)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(loss, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(3)
    with inductor_config.patch({"triton.cudagraph_trees_history_recording": True}):
        for i in range(5):  # warm-up, recording, then replays
            args = _grpo_inputs(gen)
            ref = loss(*args)
            (rdx,) = torch.autograd.grad(ref, args[0])
            out = step(*args)
            (dx,) = torch.autograd.grad(out, args[0])
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            assert torch.isfinite(dx).all() and rel_err(dx, rdx) < 1e-3, (i, rel_err(dx, rdx))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), False)
    assert mgr is not None and any(isinstance(node, cudagraph_trees.CUDAGraphNode)
                                   for nodes in mgr.roots.values() for node in nodes)


@pytest.mark.parametrize("fn", ["selective", "both, shift", "entropy, tensor temperature"])
def test_eager_call_captured_in_a_cuda_graph(fn):
    """The public functions' eager forward+backward captured in a CUDA graph (torch.cuda.graph, as
    torch.cuda.make_graphed_callables does): nothing in the path synchronizes or allocates outside
    the graph's pool, and each replay on new logits copied into the captured input gives the
    eager call's values and d logits bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    v = 3000
    x = torch.zeros(4, 9, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(0, v, (4, 8 if fn == "both, shift" else 9), device="cuda", generator=gen)
    idx[:, ::3] = -100
    temp = torch.tensor(0.7, device="cuda", requires_grad=True)
    w = torch.randn(idx.shape, device="cuda", generator=gen)

    def call(x):
        if fn == "selective":
            out = torch_fused.selective_log_softmax(x, idx, temperature=0.9)
            return (out * w).sum(), (out,), (x,)
        if fn == "both, shift":
            lp, ent = torch_fused.logprobs_and_entropy(x, idx, shift=True)
            return (lp * w).sum() + (ent * w).sum(), (lp, ent), (x,)
        ent = torch_fused.entropy_from_logits(x, temperature=temp)
        return (ent * w).sum(), (ent,), (x, temp)

    def fwd_bwd():
        loss, outs, wrt = call(x)
        return tuple(o.detach() for o in outs) + torch.autograd.grad(loss, wrt)

    from torch_fused.bench.small import cuda_graph

    replay, static_out = cuda_graph(fwd_bwd)
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen) * 3)
        replay()
        want = fwd_bwd()
        for a, b in zip(static_out, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["public", "op"])
def test_device_checks_run_on_a_repeated_call(path):
    """An index (and on the op, a tensor temperature) on the CPU with CUDA logits raises the
    checks' error on every call, including after a call of the same shapes with everything on
    CUDA (whose launch plan a repeated call reuses: the key holds the devices; it once skipped
    the checks and reached Triton's pointer error). The public functions move a CPU
    temperature to the logits' device: that call gives the CUDA temperature's result."""
    x = torch.randn(4, 64, device="cuda")
    i = torch.randint(0, 64, (4,), device="cuda")
    t = torch.tensor(0.5, device="cuda")
    call = torch_fused.selective_log_softmax if path == "public" else torch.ops.fused.selective_log_softmax
    for _ in range(2):
        call(x, i, temperature_tensor=t) if path == "op" else call(x, i, temperature=t)
        with pytest.raises(RuntimeError, match="index: expected device cuda"):
            call(x, i.cpu())
        if path == "op":
            with pytest.raises(RuntimeError, match="temperature: expected device cuda"):
                call(x, i, temperature_tensor=t.cpu())
        else:
            torch.testing.assert_close(call(x, i, temperature=t.cpu()), call(x, i, temperature=t))
