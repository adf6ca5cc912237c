"""CUDA-only SinkGD cases: the Triton path against the CPU reference on larger matrices (with
and without the spectral step), bitwise determinism of the compiled optimizer step, the eager
step's CUDA-graph replay, and the compiled step under torch.compile's CUDA graphs
(mode="reduce-overhead") against the eager step."""

from __future__ import annotations

import pytest
import torch

import torch_fused  # noqa: F401
from torch_fused.optim import SinkGD, sinkgd_step

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("spectral", [None, "unit", "muon"])
def test_triton_matches_cpu_reference_large(spectral):
    """A batched matrix, a tall one and one wider than the one-read row pass (two-pass path),
    bf16 gradients among them; with the spectral step, 2 power iterations."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 1500, 1100), (5000, 96), (40, 20000)]
    ws = [torch.randn(s, generator=gen) for s in shapes]
    gs = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    gs[1] = gs[1].bfloat16().float()
    vs = [torch.nn.functional.normalize(torch.randn(w.numel() // (s[-2] * s[-1]), s[-1], generator=gen), dim=1)
          for w, s in zip(ws, shapes)]
    kw = dict(lr=0.5, weight_decay=0.01, sinkhorn_iters=5, base_width=64.0, spectral_norm=spectral is not None,
              spectral_target=spectral or "unit", spectral_iters=2)
    wc = [w.clone() for w in ws]
    vc = [v.clone() for v in vs]
    sinkgd_step(wc, gs, spectral_vecs=vc, **kw)
    wg = [w.cuda() for w in ws]
    vg = [v.cuda() for v in vs]
    sinkgd_step(wg, [g.cuda() if i != 1 else g.cuda().bfloat16() for i, g in enumerate(gs)], spectral_vecs=vg, **kw)
    for w, a, b, va, vb in zip(ws, wc, wg, vc, vg):
        # the CPU path rounds the float64 result once: every GPU entry within one float32 ulp of
        # it (the storage rounding, large next to an update of ~1e-3 |W|) plus 1e-5 of its update
        d_ref = a.double() - w.double()
        err = (b.cpu().double() - a.double()).abs()
        bound = torch.finfo(torch.float32).eps * a.double().abs() + 1e-5 * d_ref.abs() + 1e-12
        assert bool((err <= bound).all()), (err / bound).max().item()
        if spectral:
            assert ((vb.cpu() - va).norm() / va.norm()).item() < 1e-5


def test_compiled_optimizer_step_is_bitwise_deterministic():
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda().bfloat16()
        opt = SinkGD(model.parameters(), lr=torch.tensor(0.1, device="cuda"), spectral_norm=True, stochastic_round=True)
        torch._dynamo.reset()
        step = torch.compile(lambda: opt.step(), fullgraph=True)
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            step()
        outs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


SHAPES = [(256, 768), (768, 3072), (3, 64, 96), (40, 20000)]  # the last: wider than the one-read row pass


def _graph_run(graphs, settings_override, lr_tensor, stochastic, spectral=False):
    """Five optimizer steps on mixed shapes (one wider than the one-read row pass), new gradient
    values and a changed lr along the way; returns the weights (and the spectral vectors) and
    how many graphs were made."""
    settings_override(sinkgd_graphs=graphs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).bfloat16()) for s in SHAPES]
    for p in params:
        p.grad = torch.empty_like(p)
    lr = torch.tensor(1e-2, device="cuda") if lr_tensor else 1e-2
    opt = SinkGD(params, lr=lr, stochastic_round=stochastic, spectral_norm=spectral, spectral_target="muon")
    for i in range(5):
        for p in params:  # new values at the same addresses, as a backward pass into .grad does
            p.grad.copy_(torch.randn(p.shape, device="cuda", generator=gen))
        if i == 3:  # a new lr: in place for a tensor lr, a new float otherwise
            if lr_tensor:
                lr.fill_(3e-2)
            else:
                opt.param_groups[0]["lr"] = 3e-2
        opt.step()
    torch.cuda.synchronize()
    made = sum(len(plan.graphs) for plan in opt.plan_cache.plans.values())
    vecs = [opt.state[p]["spectral_v"].clone() for p in params] if spectral else []
    return [p.detach().clone() for p in params] + vecs, made


@pytest.mark.parametrize("lr_tensor,stochastic,spectral", [(True, True, False), (True, False, False),
                                                           (False, True, False), (True, True, True)])
def test_graph_replay_matches_direct_launches(settings_override, lr_tensor, stochastic, spectral):
    """The optimizer step replayed from a CUDA graph gives the same bits as launching the
    kernels each step, including steps after new gradient values and a new lr, with and
    without the spectral step."""
    direct, made_off = _graph_run(False, settings_override, lr_tensor, stochastic, spectral)
    replayed, made_on = _graph_run(True, settings_override, lr_tensor, stochastic, spectral)
    assert made_off == 0
    if lr_tensor:  # the lr tensor keeps its address: the graph is made on the second step
        assert made_on >= 1
    for a, b in zip(direct, replayed):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16),
                           b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16))


def _compiled_run(spectral, compiled, steps=6):
    """``steps`` optimizer steps of SinkGD on mixed shapes (a batched and a wide matrix among
    them), fresh gradient values every step and the lr changed in place at step 3; the step
    called eagerly or through torch.compile(mode="reduce-overhead") (inductor's CUDA graphs)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).bfloat16()) for s in SHAPES]
    for p in params:
        p.grad = torch.empty_like(p)
    lr = torch.tensor(1e-2, device="cuda")
    opt = SinkGD(params, lr=lr, weight_decay=0.1, stochastic_round=True, spectral_norm=spectral,
                 spectral_target="muon")
    torch._dynamo.reset()
    step = torch.compile(lambda: opt.step(), mode="reduce-overhead", fullgraph=True) if compiled else opt.step
    for i in range(steps):
        for p in params:
            p.grad.copy_(torch.randn(p.shape, device="cuda", generator=gen))
        if i == 3:
            lr.fill_(3e-2)
        step()
    torch.cuda.synchronize()
    if compiled:  # inductor recorded CUDA graphs (and did not fall back to running eagerly)
        from torch._inductor import cudagraph_trees

        mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), False)
        assert mgr is not None and any(isinstance(node, cudagraph_trees.CUDAGraphNode)
                                       for nodes in mgr.roots.values() for node in nodes)
    vecs = [opt.state[p]["spectral_v"].clone() for p in params] if spectral else []
    return [p.detach().clone() for p in params], vecs


@pytest.mark.parametrize("spectral", [False, True], ids=["plain", "spectral"])
def test_compiled_step_under_cuda_graphs_matches_eager(spectral):
    """torch.compile(mode="reduce-overhead") runs the step under inductor's CUDA graphs (warm-up,
    capture, then replays; no skip) and gives the eager step's bits, through new gradients and
    an lr changed in place: the op keeps no tensor made during the capture, and the captured
    work tables are read at every replay."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    eager_w, eager_v = _compiled_run(spectral, compiled=False)
    counters.clear()
    # a failure of inductor's pool check then names where each stray tensor was allocated
    with inductor_config.patch({"triton.cudagraph_trees_history_recording": True}):
        comp_w, comp_v = _compiled_run(spectral, compiled=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    for a, b in zip(eager_w, comp_w):
        if not spectral:
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        else:  # spectral: within one bf16 ulp per entry, at most 0.1% of the entries differing
            ulp = torch.ldexp(torch.ones_like(a.float()), torch.frexp(a.float())[1] - 8)
            assert bool(((a.float() - b.float()).abs() <= ulp).all())
            assert (a != b).float().mean().item() < 1e-3
    for a, b in zip(eager_v, comp_v):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_checkpoint_loaded_on_the_cpu_keeps_stepping_on_the_gpu():
    """A state_dict saved and loaded with map_location="cpu" into a new optimizer of CUDA
    parameters: the step counts come back on the GPU, and the next steps (stochastic rounding,
    an AdamW-routed bias, the eager CUDA graph after two steps) equal the original optimizer's."""
    import io

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).cuda().bfloat16()
    kw = dict(lr=0.2, stochastic_round=True, fallback_kwargs=dict(lr=1e-2))
    opt = SinkGD(lin.parameters(), **kw)
    grads = [[torch.randn_like(p) for p in lin.parameters()] for _ in range(5)]

    def step(o, params, g):
        for p, x in zip(params, g):
            p.grad = x.clone()
        o.step()

    step(opt, list(lin.parameters()), grads[0])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin = torch.nn.Linear(64, 48).cuda().bfloat16()
    twin.load_state_dict(lin.state_dict())
    opt2 = SinkGD(twin.parameters(), **kw)
    opt2.load_state_dict(torch.load(buf, map_location="cpu", weights_only=True))
    for st in opt2.state.values():
        assert st["step"].device.type == "cuda"
    for g in grads[1:]:
        step(opt, list(lin.parameters()), g)
        step(opt2, list(twin.parameters()), g)
    for a, b in zip(lin.parameters(), twin.parameters()):
        assert torch.equal(a, b)
