"""Registration-level tests of the log-prob/entropy ops: opcheck, gradcheck, torch.compile,
pinned schemas and input errors (eager and compiled alike)."""

from __future__ import annotations

import math

import expecttest
import pytest
import torch

import torch_fused
from _helpers import DEVICES, SMALL, make_logits
from torch.utils._python_dispatch import TorchDispatchMode
from torch_fused._library import INTERPRET

OPS = torch.ops.fused


def _samples(device):
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.bfloat16,) if SMALL else (torch.float32, torch.bfloat16):
        x = make_logits((2, 3), 37, dtype, device, "sliced", gen=g).requires_grad_(True)
        idx = torch.randint(0, 37, (2, 3), generator=g).to(device)
        idxk = torch.randint(0, 37, (2, 3, 2), generator=g).to(device)
        out.append((x, idx, idxk))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_all_ops(device):
    for x, idx, idxk in _samples(device):
        torch.library.opcheck(OPS.selective_log_softmax, (x, idx), {"temperature": 0.8})
        torch.library.opcheck(OPS.selective_log_softmax, (x, idxk, 1.0, 5))
        torch.library.opcheck(OPS.entropy_from_logits, (x,), {"temperature": 1.3})
        torch.library.opcheck(OPS.logprobs_and_entropy, (x, idx, 0.9, -100))
        torch.library.opcheck(OPS._logprobs_entropy_forward, (x, idxk, None, 1.0, -100, True, False))
        torch.library.opcheck(OPS._logprobs_entropy_forward, (x, None, None, 2.0, -100, True, False))
        # shift: the [B, L+1, V] tensor the sliced sample is a view of; a tensor temperature
        full = x._base if x._base is not None else x
        full = full.detach().requires_grad_(True)
        t = torch.tensor(0.8, device=device, requires_grad=True)
        torch.library.opcheck(OPS.logprobs_and_entropy, (full, idx), {"shift": True})
        torch.library.opcheck(OPS.logprobs_and_entropy, (x, idx), {"temperature_tensor": t})
        torch.library.opcheck(OPS._logprobs_entropy_forward, (full, idxk, t, 1.0, -100, True, True))
        lp, ent, stats = OPS._logprobs_entropy_forward(x.detach(), idx, None, 1.0, -100, True, False)
        g1 = torch.randn_like(lp)
        g2 = torch.randn_like(ent)
        for gl, gh in [(g1, g2), (g1, None), (None, g2)]:
            torch.library.opcheck(
                OPS._logprobs_entropy_backward, (gl, gh, x.detach(), idx, stats, ent, None, 1.0, -100, True, False)
            )
        lp, ent, stats = OPS._logprobs_entropy_forward(full.detach(), idx, None, 1.0, -100, True, True)
        torch.library.opcheck(OPS._logprobs_entropy_backward,
                              (torch.randn_like(lp), torch.randn_like(ent), full.detach(), idx, stats, ent, None, 1.0,
                               -100, True, True))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float64(device):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 13, generator=g, dtype=torch.float64) * 2).to(device).requires_grad_(True)
    idx = torch.randint(0, 13, (2, 3), generator=g).to(device)
    idx[0, 1] = -100
    idxk = torch.randint(0, 13, (2, 3, 3), generator=g).to(device)
    assert torch.autograd.gradcheck(lambda t: torch_fused.selective_log_softmax(t, idx, temperature=0.7), (x,))
    assert torch.autograd.gradcheck(lambda t: torch_fused.selective_log_softmax(t, idxk), (x,))
    assert torch.autograd.gradcheck(lambda t: torch_fused.entropy_from_logits(t, temperature=1.9), (x,))
    assert torch.autograd.gradcheck(lambda t: torch_fused.logprobs_and_entropy(t, idx, temperature=1.1), (x,))
    assert torch.autograd.gradcheck(lambda t: torch_fused.logprobs_and_entropy(t, idx[:, :2], shift=True), (x,))


def _pg_loss(logits, index, adv, beta):
    logp, ent = torch.ops.fused.logprobs_and_entropy(logits[:, :-1], index, 1.0, -100)
    return -(adv[:, None] * logp).mean() - beta * ent.mean()


def _pg_loss_shift(logits, index, adv, beta):
    logp, ent = torch_fused.logprobs_and_entropy(logits, index, shift=True)
    return -(adv[:, None] * logp).mean() - beta * ent.mean()


@pytest.mark.parametrize("loss_fn", [_pg_loss, _pg_loss_shift], ids=["slice", "shift"])
def test_compile_fullgraph_dynamic_length_no_recompile(loss_fn):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    # the interpreter run checks the trace through the real kernels; Inductor's code generation
    # (the same for either implementation, as the op is opaque) is the plain run's
    cnt = CompileCounterWithBackend("aot_eager" if INTERPRET else "inductor")
    step = torch.compile(loss_fn, fullgraph=True, backend=cnt, dynamic=True)
    # the interpreter runs one program per row: shorter sequences there, the same vocabulary
    for length in (3, 5, 9) if INTERPRET else (9, 17, 33):
        g = torch.Generator().manual_seed(length)
        logits = torch.randn(2, length + 1, 50, generator=g, requires_grad=True)
        index = torch.randint(0, 50, (2, length), generator=g)
        adv = torch.randn(2, generator=g)
        loss = step(logits, index, adv, 0.01)
        loss.backward()
        ref_logits = logits.detach().clone().requires_grad_(True)
        ref = loss_fn(ref_logits, index, adv, 0.01)
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert cnt.frame_count == 1, f"recompiled across sequence lengths: {cnt.frame_count} frames"


def _record_aot_graphs():
    """A torch.compile backend that keeps the forward and backward graphs AOTAutograd makes."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, _inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")), graphs


def _fused_targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "fused" in str(n.target)]


@pytest.mark.parametrize("public", ["selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy"])
@pytest.mark.parametrize("shift", [False, True])
def test_compile_graph_holds_opaque_core_ops(public, shift):
    """The public ops decompose to exactly one opaque core node forward and one backward; no
    public (composite) op, and with shift no slice of the logits, is left in the graphs."""
    torch._dynamo.reset()
    backend, graphs = _record_aot_graphs()
    fn = getattr(torch_fused, public)

    def f(x, i):
        out = fn(x, shift=shift) if public == "entropy_from_logits" else fn(x, i, shift=shift)
        return sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()

    x = torch.randn(2, 4, 20, requires_grad=True)
    i = torch.randint(0, 20, (2, 3 if shift else 4))
    torch.compile(f, fullgraph=True, backend=backend)(x, i).backward()
    (fw,), (bw,) = graphs["fw"], graphs["bw"]
    assert _fused_targets(fw) == ["fused._logprobs_entropy_forward.default"], fw.code
    assert _fused_targets(bw) == ["fused._logprobs_entropy_backward.default"], bw.code
    if shift:
        for gm in (fw, bw):
            assert not any("slice" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"), gm.code


def _trace_cuda_ops(shift, symbolic=False, **settings):
    """The functionalized graph (AOTAutograd, the graph Inductor lowers) of one forward and one
    backward core-op call on fake CUDA tensors: it traces on a machine without a GPU. symbolic:
    the batch and sequence sizes are symbolic (a dynamic-shape compile), the vocabulary static."""
    from torch._dynamo.source import ConstantSource
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()

    def size(v, name):
        if not symbolic:
            return v
        if symbolic == "unbacked":  # a data-dependent size, as nonzero() gives
            u = env.create_unbacked_symint()
            torch._check(u >= 2)
            return u
        src = ConstantSource(name)
        return env.create_symintnode(env.create_symbol(v, src, dynamic_dim=DimDynamic.DYNAMIC), hint=v, source=src)

    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm

    def f(x, ids, g1, g2):
        logp, ent, stats = OPS._logprobs_entropy_forward(x, ids, None, 1.0, -100, True, shift)
        return OPS._logprobs_entropy_backward(g1, g2, x, ids, stats, ent, None, 1.0, -100, True, shift)[0]

    with FakeTensorMode(shape_env=env), torch_fused.settings.override(**settings):
        b, length = size(2, "B"), size(8, "L")
        x = torch.randn(b, length + 1 if shift else length, 64, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, 64, (b, length), device="cuda")
        g1, g2 = torch.randn(b, length, device="cuda"), torch.randn(b, length, device="cuda")
        aot_function(f, fw_compiler=record)(x, ids, g1, g2)
    (gm,) = graphs
    for n in gm.graph.nodes:
        if "triton_kernel_wrapper_functional" in str(n.target):
            # each argument the kernel may write gets its own copy in the functional graph, and the
            # copy of the last argument naming a tensor replaces it: a written argument must name
            # a tensor no other argument names (else the output may be an unwritten copy)
            kw = n.kwargs["kwargs"]
            for name in n.kwargs["tensors_to_clone"]:
                shared = [k for k, a in kw.items() if k != name and a is kw[name]]
                assert not shared, f"{name} may be written, and its tensor is passed as {shared} too"
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and ("fused" in str(n.target) or "triton_kernel" in str(n.target))]


@pytest.mark.skipif(not torch_fused._library.TRITON_DEVICES or INTERPRET, reason="needs triton (not the interpreter)")
@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="traces fake CUDA tensors: needs a CUDA build of torch")
@pytest.mark.filterwarnings("ignore")
def test_compiled_graph_launches_the_kernels_itself():
    """settings.compile_inline_kernels: under torch.compile a CUDA call's kernel launches are
    traced into the graph (Inductor then launches them itself), in place of the opaque op, with
    static or symbolic batch and sequence sizes; with shift the backward stays an op call (its d
    logits is written through two views); off: opaque ops."""
    wrapper = "triton_kernel_wrapper_functional"
    ops = ["fused._logprobs_entropy_forward.default", "fused._logprobs_entropy_backward.default"]
    assert _trace_cuda_ops(False, compile_inline_kernels=True) == [wrapper, wrapper]
    assert _trace_cuda_ops(True, compile_inline_kernels=True) == [wrapper, ops[1]]
    # a dynamic batch and sequence length (the vocabulary static): inlined as well
    assert _trace_cuda_ops(False, symbolic=True, compile_inline_kernels=True) == [wrapper, wrapper]
    assert _trace_cuda_ops(True, symbolic=True, compile_inline_kernels=True) == [wrapper, ops[1]]
    assert _trace_cuda_ops(False, compile_inline_kernels=False) == ops
    # a data-dependent (unbacked) batch and length: the launch plans would have to decide them
    # (a data-dependent-guard error): the ops stay whole
    assert _trace_cuda_ops(False, symbolic="unbacked", compile_inline_kernels=True) == ops


def test_inline_setting_keys_the_compile_caches():
    """Dynamo traces the same graph whether the log-prob launches are then inlined or not, so
    torch.compile's caches would hand a graph compiled under one compile_inline_kernels value to a
    compile under the other: a value other than the default goes into the caches' tag (after the
    user's own), and leaves it when the setting is back."""
    import torch.compiler.config as cc

    from torch_fused import settings

    saved = cc.cache_key_tag  # (monkeypatch's undo would delete a config entry, not restore it)
    cc.cache_key_tag = "mine"
    schemas = f"torch_fused:schemas={settings.schemas_fingerprint()}"
    try:
        default = settings._INLINE_DEFAULT
        with torch_fused.settings.override(compile_inline_kernels=default):
            assert cc.cache_key_tag == f"mine|{schemas}"
            with torch_fused.settings.override(compile_inline_kernels=not default):
                assert cc.cache_key_tag == f"mine|{schemas}|torch_fused:compile_inline_kernels={int(not default)}"
            assert cc.cache_key_tag == f"mine|{schemas}"
    finally:
        cc.cache_key_tag = saved


def test_compile_caches_are_keyed_by_the_ops_schemas():
    """A public op's traced call can stay the same while a core op's schema changes (a new
    argument): the ops' schema fingerprint is in torch.compile's cache tag from import on, and
    another schema gives another fingerprint, so a graph cached against an earlier release's
    schemas is not fetched."""
    import torch.compiler.config as cc

    from torch_fused import settings

    before = settings.schemas_fingerprint()
    assert f"torch_fused:schemas={before}" in cc.cache_key_tag.split("|")
    lib = torch.library.Library("fused", "FRAGMENT")
    try:
        lib.define("_fingerprint_probe(Tensor x, int k=1) -> Tensor")
        assert settings.schemas_fingerprint() != before
    finally:
        lib._destroy()
    assert settings.schemas_fingerprint() == before


class TestSchemas(expecttest.TestCase):
    def test_pinned_schemas(self):
        self.assertExpectedInline(
            str(OPS.selective_log_softmax.default._schema),
            """fused::selective_log_softmax(Tensor logits, Tensor index, float temperature=1., int ignore_index=-100, *, bool shift=False, int? top_k=None, float? top_p=None, float? min_p=None, Tensor? temperature_tensor=None) -> Tensor""",
        )
        self.assertExpectedInline(
            str(OPS.entropy_from_logits.default._schema),
            """fused::entropy_from_logits(Tensor logits, float temperature=1., *, bool shift=False, int? top_k=None, float? top_p=None, float? min_p=None, Tensor? temperature_tensor=None) -> Tensor""",
        )
        self.assertExpectedInline(
            str(OPS.logprobs_and_entropy.default._schema),
            """fused::logprobs_and_entropy(Tensor logits, Tensor index, float temperature=1., int ignore_index=-100, *, bool shift=False, int? top_k=None, float? top_p=None, float? min_p=None, Tensor? temperature_tensor=None) -> (Tensor, Tensor)""",
        )
        self.assertExpectedInline(
            str(OPS._logprobs_entropy_forward.default._schema),
            """fused::_logprobs_entropy_forward(Tensor logits, Tensor? index, Tensor? temperature_t, float temperature, SymInt ignore_index, bool compute_entropy, bool shift, Tensor? threshold=None, Tensor? support=None) -> (Tensor, Tensor, Tensor)""",
        )
        self.assertExpectedInline(
            str(OPS._logprobs_entropy_backward.default._schema),
            """fused::_logprobs_entropy_backward(Tensor? grad_logp, Tensor? grad_entropy, Tensor logits, Tensor? index, Tensor stats, Tensor entropy, Tensor? temperature_t, float temperature, SymInt ignore_index, bool compute_entropy, bool shift, Tensor? threshold=None, Tensor? support=None, *, bool temperature_grad=True) -> (Tensor, Tensor)""",
        )
        self.assertExpectedInline(
            str(OPS._sampler_threshold.default._schema),
            """fused::_sampler_threshold(Tensor logits, Tensor? temperature_t, float temperature, bool shift, int? top_k, float? top_p, float? min_p) -> (Tensor, Tensor)""",
        )


BAD_INPUTS = [
    ("int logits", lambda: (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long), 1.0),
     r"logits: expected dtype float16, bfloat16, float32 or float64, got torch.int64"),
    ("float index", lambda: (torch.randn(2, 5), torch.zeros(2), 1.0), r"index: expected dtype int32 or int64, got torch.float32"),
    ("shape mismatch", lambda: (torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), 1.0),
     r"index: expected shape \(2, 3\) \(one id per row\) or \(2, 3, 'K'\)"),
    ("zero temperature", lambda: (torch.randn(2, 5), torch.zeros(2, dtype=torch.long), 0.0),
     r"temperature: expected a positive finite number, got 0.0"),
    ("negative temperature", lambda: (torch.randn(2, 5), torch.zeros(2, dtype=torch.long), -1.0),
     r"temperature: expected a positive finite number, got -1.0"),
    ("infinite temperature", lambda: (torch.randn(2, 5), torch.zeros(2, dtype=torch.long), float("inf")),
     r"temperature: expected a positive finite number, got inf"),
    ("empty vocab", lambda: (torch.randn(2, 0), torch.zeros(2, dtype=torch.long), 1.0),
     r"logits: the last dim \(vocabulary V\) must be >= 1"),
    ("temperature on another device", lambda: (torch.randn(2, 5), torch.zeros(2, dtype=torch.long),
                                               torch.tensor(0.5, device="meta")),
     r"temperature: a tensor on meta with logits on cpu"),
]


@pytest.mark.parametrize("name,make,msg", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bad_input_clear_error(name, make, msg, mode):
    logits, index, t = make()

    def f(x, i):
        return torch_fused.selective_log_softmax(x, i, temperature=t)

    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=msg):
        f(logits, index)
    if name not in ("float index", "shape mismatch"):
        def g(x):
            return torch_fused.entropy_from_logits(x, temperature=t)

        if mode == "compiled":
            g = torch.compile(g, fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception, match=msg):
            g(logits)


def _plain(fn, x, idx, w=None):
    """The plain PyTorch formula of each public function, float64 (x: logits, or hidden with w)."""
    z = x.double() @ w.double().t() if w is not None else x.double()
    z = torch.log_softmax(z, -1)
    lp = z.gather(-1, idx[..., None]).squeeze(-1)
    ent = -(z.exp() * z).sum(-1)
    return {"selective_log_softmax": (lp,), "entropy_from_logits": (ent,)}.get(fn, (lp, ent))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy",
                                "linear_logprobs_and_entropy"])
def test_outputs_can_be_modified_in_place(device, fn):
    """Outputs behave like the plain formula's: not views, writable in place, and a write into
    one (the entropy the backward uses included) changes the gradient exactly as it changes the
    plain formula's (the written element contributes nothing)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 37, generator=g).to(device).requires_grad_(True)
    w = torch.randn(37, 8, generator=g).to(device).requires_grad_(True)
    h = torch.randn(2, 3, 8, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 37, (2, 3), generator=g).to(device)
    if fn == "linear_logprobs_and_entropy":
        ours = torch_fused.linear_logprobs_and_entropy(h, w, idx)
        ins, xd = (h, w), (h.detach().cpu().double().requires_grad_(True),
                           w.detach().cpu().double().requires_grad_(True))
        plain = _plain(fn, xd[0], idx.cpu(), xd[1])
    else:
        call = getattr(torch_fused, fn)
        ours = call(x) if fn == "entropy_from_logits" else call(x, idx)
        ins, xd = (x,), (x.detach().cpu().double().requires_grad_(True),)
        plain = _plain(fn, xd[0], idx.cpu())
    ours = ours if isinstance(ours, tuple) else (ours,)
    for o, p in zip(ours, plain):
        assert not o._is_view(), "an output is a view"
        o[0, 1] = 0.0  # the element then contributes nothing downstream
        with torch.no_grad():
            p[0, 1] = 0.0
    gs = [torch.randn(o.shape, generator=g) for o in ours]
    got = torch.autograd.grad(sum((o * gg.to(device)).sum() for o, gg in zip(ours, gs)), ins)
    # the plain formula with the same writes: p * mask, differentiated
    keep = torch.ones(2, 3, dtype=torch.float64)
    keep[0, 1] = 0
    want = torch.autograd.grad(sum((p * keep * gg.double()).sum() for p, gg in zip(plain, gs)), xd)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_extreme_temperatures_give_the_limits(device, as_tensor):
    """Any positive finite temperature: below T_MIN / above T_MAX it acts as the nearer end,
    where the results are the limits (one-hot / uniform) to fp32 accuracy, the same on every
    path (the kernels' log2(e) / T overflowed or went subnormal: NaN)."""
    from torch_fused._library import T_MAX, T_MIN

    g = torch.Generator().manual_seed(3)
    v = 37
    x = torch.randn(2, 3, v, generator=g).to(device)
    idx = torch.randint(0, v, (2, 3), generator=g).to(device)
    top = x.argmax(-1)

    def run(t):
        t = torch.tensor(t, device=device, dtype=torch.float64) if as_tensor else t
        return torch_fused.logprobs_and_entropy(x, idx, temperature=t)

    for cold in (1e-39, 1e-45, 1e-300):
        lp, ent = run(cold)
        lp_end, ent_end = run(T_MIN)
        assert torch.equal(lp, lp_end) and torch.equal(ent, ent_end)
        assert bool((ent == 0).all())
        assert bool(torch.where(idx == top, lp == 0, lp < -1e29).all())
    for hot in (1e38, 3e38, 1e300):
        lp, ent = run(hot)
        torch.testing.assert_close(ent, torch.full_like(ent, math.log(v)), rtol=1e-6, atol=0)
        torch.testing.assert_close(lp, torch.full_like(lp, -math.log(v)), rtol=1e-6, atol=0)
        assert torch.equal(lp, run(T_MAX)[0])
    # small temperatures with large logits: log2(e) / T times the row max reaches 1e13 (the GPU
    # kernels' rounded shift of the max overflowed exp2 there): still the one-hot limit
    x = x * 1e3
    for cold in (1e-6, 1e-9):
        lp, ent = run(cold)
        assert bool((ent == 0).all()), ent
        assert bool(torch.where(idx == top, lp == 0, lp < -1e3).all()), lp
    if not as_tensor:
        h = torch.randn(2, 3, 8, generator=g).to(device) * 30
        w = torch.randn(v, 8, generator=g).to(device) * 30
        lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, temperature=1e-7)
        top_h = (h.double() @ w.double().t()).argmax(-1)
        assert bool((ent == 0).all()) and not bool(lp.isnan().any())
        assert bool(torch.where(idx == top_h, lp == 0, lp < -1e3).all()), lp


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_gradient_is_zero_where_the_temperature_is_clamped(device):
    """Outside [T_MIN, T_MAX] a tensor temperature acts as the nearer end, a constant: its
    gradient is 0 there (it was -(1/T_MIN) sum x dx, up to 1e31 times too large), and the usual
    one at the ends themselves; checked in the temperature's own dtype (a float64 1e-300 is a
    positive temperature, not 0)."""
    from torch_fused._library import T_MAX, T_MIN

    g = torch.Generator().manual_seed(6)
    v = 37
    x = torch.randn(2, 3, v, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, v, (2, 3), generator=g).to(device)

    def d_t(value, dtype):
        t = torch.tensor(value, device=device, dtype=dtype, requires_grad=True)
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t)
        return torch.autograd.grad((lp * 0.3).sum() + ent.sum(), t)[0]

    for value, dtype in ((1e-300, torch.float64), (1e300, torch.float64), (1e-39, torch.float32),
                         (3e38, torch.float32), (2.0 * T_MAX, torch.float32), (T_MIN / 2, torch.float32)):
        dt = d_t(value, dtype)
        assert dt.dtype == dtype and dt.item() == 0.0, (value, dtype, dt)
    # at the ends themselves (and inside) the ops still depend on T: the float64 formula's
    # gradient. At the ends the logits are scaled by T so that z = x / T is of order 1 (else the
    # softmax is one-hot or uniform and the true gradient rounds to 0 in fp32)
    for value, scale in ((1.0, 1.0), (0.5, 1.0), (T_MIN, T_MIN), (T_MAX, T_MAX)):
        x = (torch.randn(2, 3, v, generator=g) * scale).to(device).requires_grad_(True)
        dt = d_t(value, torch.float64).item()
        tr = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        z = x.detach().cpu().double() / tr
        lp = torch.log_softmax(z, -1)
        ent = -(lp.exp() * lp).sum(-1)
        want = torch.autograd.grad((lp.gather(-1, idx.cpu()[..., None])[..., 0] * 0.3).sum() + ent.sum(), tr)[0]
        assert dt != 0.0 and abs(dt - want.item()) <= 1e-4 * abs(want.item()), (value, dt, want.item())


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_gradient_ignores_a_constant_logit_offset(device):
    """d T depends on the logits only through their differences within a row: rows shifted by a
    constant 1e4 (all-equal rows included) give the same d T (the unshifted sum of x dx lost it)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 8, 33, generator=g).double()
    x[0] = 0.0  # all-equal rows: d T is exactly 0
    idx = torch.randint(0, 33, (4, 8), generator=g).to(device)
    gl, ge = torch.randn(4, 8, generator=g).to(device), torch.randn(4, 8, generator=g).to(device)
    grads = []
    for off in (0.0, 1e4):
        t = torch.tensor(0.7, device=device, requires_grad=True)
        lp, ent = torch_fused.logprobs_and_entropy((x + off).float().to(device), idx, temperature=t)
        (dt,) = torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), t)
        grads.append(dt.item())
    # 1e4 + N(0, 1) in fp32 keeps the differences to about 1e-3 * ulp(1e4): tolerance from that
    assert abs(grads[1] - grads[0]) <= 2e-3 * (abs(grads[0]) + 1), grads
    xe = torch.zeros(2, 5, 33, device=device) + 1e4
    t = torch.tensor(1.3, device=device, requires_grad=True)
    lp, ent = torch_fused.logprobs_and_entropy(xe, torch.zeros(2, 5, dtype=torch.long, device=device), temperature=t)
    (dt,) = torch.autograd.grad(lp.sum() + ent.sum(), t)
    assert abs(dt.item()) < 1e-6, dt.item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy"])
def test_tensor_temperature_without_grad_scales_the_logits_gradient(device, fn):
    """A tensor temperature that does not require grad is still the T of d logits (the backward
    used the float placeholder 1.0: gradients off by the factor the temperature applies)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 29, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 29, (3, 4), generator=g).to(device)
    call = getattr(torch_fused, fn)
    grads = []
    for t in (0.5, torch.tensor(0.5, device=device)):
        out = call(x, temperature=t) if fn == "entropy_from_logits" else call(x, idx, temperature=t)
        out = out if isinstance(out, tuple) else (out,)
        grads.append(torch.autograd.grad(sum(o.sum() for o in out), x)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [-1.0, 0.0, float("inf"), float("nan")], ids=["negative", "zero", "inf", "nan"])
def test_bad_tensor_temperature_on_the_kernel_path_gives_nan(device, bad):
    """A tensor temperature that is not positive and finite, on the Triton path (which cannot
    read it without a sync): every output and gradient is NaN, as documented (the CPU reference
    raises ValueError: tests/test_logprobs.py). Zero, negative and NaN once ran as T = 2^-100
    and inf as T = 2^100, finite wrong values, because the kernel's clamp dropped the NaN."""
    if device not in torch_fused._library.TRITON_DEVICES:
        pytest.skip("the CPU reference path raises ValueError here (the interpreter run takes the kernel path)")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 37, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 37, (3,), generator=g).to(device)
    t = torch.tensor(bad, device=device, requires_grad=True)
    lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t)
    only = torch_fused.selective_log_softmax(x, idx, temperature=t)
    dx, dt = torch.autograd.grad(lp.sum() + ent.sum() + only.sum(), (x, t))
    for name, out in (("logp", lp), ("entropy", ent), ("selective", only), ("d logits", dx), ("d T", dt)):
        assert torch.isnan(out).all(), f"{name}: {out}"


@pytest.mark.parametrize("how", ["torch.func.jvp", "forward_ad", "torch.func.grad"])
@pytest.mark.parametrize("path", ["public", "op"])
def test_forward_mode_and_func_grad_raise_clearly(how, path):
    """The ops have reverse-mode formulas only. Forward mode once gave a zero tangent (jvp) or
    none (forward_ad on the op) without a word, and torch.func.grad failed inside torch.library:
    each now raises NotImplementedError naming the op and the way out, on the public function
    and the op alike."""
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(3, 11)
    idx = torch.randint(0, 11, (3,))
    head_w, head_h = torch.randn(11, 4), torch.randn(3, 4)
    fns = {"public": [lambda a: torch_fused.selective_log_softmax(a, idx), torch_fused.entropy_from_logits,
                      lambda a: torch_fused.logprobs_and_entropy(a, idx)[1]],
           "op": [lambda a: torch.ops.fused.selective_log_softmax(a, idx), torch.ops.fused.entropy_from_logits,
                  lambda a: torch.ops.fused.logprobs_and_entropy(a, idx)[1]]}[path]
    head = {"public": torch_fused.linear_logprobs_and_entropy, "op": torch.ops.fused.linear_logprobs_and_entropy}[path]
    # the fused head through each differentiable input: hidden, weight, bias (it gave a zero tangent)
    heads = [lambda a: head(a[:, :4], head_w, idx)[0], lambda a: head(head_h, a, idx)[1],
             lambda a: head(head_h, head_w, idx, bias=a[0])[0]]
    head_x = [torch.randn(3, 11), torch.randn(11, 4), torch.randn(3, 11)]

    def differentiate(fn, a):  # fn differentiated at a the way ``how`` names
        if how == "torch.func.jvp":
            torch.func.jvp(fn, (a,), (torch.randn_like(a),))
        elif how == "forward_ad":
            with fwAD.dual_level():
                fn(fwAD.make_dual(a, torch.randn_like(a)))
        else:
            torch.func.grad(lambda b: fn(b).sum())(a)

    for fn, hx in zip(heads, head_x):
        with pytest.raises(NotImplementedError, match=r"linear_logprobs_and_entropy: forward-mode AD .* not supported"):
            differentiate(fn, hx)
    for fn, name in zip(fns, ["selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy"]):
        with pytest.raises(NotImplementedError, match=name + r": forward-mode AD .* not supported through the op"):
            differentiate(fn, x)
    # logits that are a constant of the transform pass: d/dw of (w * f(x)).sum() is f(x)
    w = torch.randn(3)
    for fn in fns[:2] + [lambda a: head(head_h, head_w, idx)[1]]:
        want = fn(x)
        if how == "torch.func.grad":
            got = torch.func.grad(lambda a: (a * fn(x)).sum())(w)
        elif how == "torch.func.jvp":
            got = torch.func.jvp(lambda a: (a * fn(x)).sum(), (w,), (torch.ones(3),))[1]
            want = want.sum()
        else:
            with fwAD.dual_level():
                got = fwAD.unpack_dual((fwAD.make_dual(w, torch.ones(3)) * fn(x)).sum()).tangent
            want = want.sum()
        torch.testing.assert_close(got, want)
    # reverse mode and vmap are unaffected
    x.requires_grad_(True)
    (g,) = torch.autograd.grad(fns[0](x).sum(), x)
    torch.testing.assert_close(g, torch.autograd.grad(torch.log_softmax(x, -1).gather(-1, idx[:, None]).sum(), x)[0])
    out = torch.func.vmap(fns[1])(x.detach()[:, None])
    torch.testing.assert_close(out[:, 0], torch.distributions.Categorical(logits=x.detach()).entropy())


@pytest.mark.parametrize("bad", [None, 1.5, True, "x"])
def test_ignore_index_of_the_wrong_type_names_the_argument(bad):
    x = torch.randn(2, 5)
    i = torch.zeros(2, dtype=torch.long)
    h, w = torch.randn(2, 3), torch.randn(5, 3)
    for call in (lambda: torch_fused.selective_log_softmax(x, i, ignore_index=bad),
                 lambda: torch_fused.logprobs_and_entropy(x, i, ignore_index=bad),
                 lambda: torch_fused.linear_logprobs_and_entropy(h, w, i, ignore_index=bad)):
        with pytest.raises(TypeError, match=r"ignore_index: expected an int .* got " + repr(bad).replace(".", r"\.")):
            call()


def _fast_path_cases(device):
    g = torch.Generator().manual_seed(3)
    x = make_logits((2, 4), 37, torch.float32, device, "sliced", gen=g)
    full = x._base if x._base is not None else x
    idx = torch.randint(0, 37, (2, 4), generator=g).to(device)
    idx[0, 1] = -100
    idxk = torch.randint(0, 37, (2, 4, 3), generator=g).to(device)
    t = torch.tensor(0.7, device=device)
    return [
        ("selective_log_softmax", (x, idx), {"temperature": 0.8}),
        ("selective_log_softmax", (x, idxk), {}),
        ("entropy_from_logits", (x,), {"temperature": t}),
        ("logprobs_and_entropy", (x, idx), {}),
        ("logprobs_and_entropy", (full, idx), {"shift": True, "temperature": t}),
        ("logprobs_and_entropy", (x, idxk), {"temperature": 1.3}),
    ]


def _outputs_and_grads(fn, args, kwargs):
    x = args[0].detach().requires_grad_(True)
    t = kwargs.get("temperature")
    kw = dict(kwargs)
    leaves = [x]
    if isinstance(t, torch.Tensor):
        kw["temperature"] = t.detach().requires_grad_(True)
        leaves.append(kw["temperature"])
    out = getattr(torch_fused, fn)(x, *args[1:], **kw)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(5)
    loss = sum((o * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in out)
    return out + torch.autograd.grad(loss, leaves)


class _SeenOps(TorchDispatchMode):
    """Records the fused:: ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fused":
            self.seen.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_eager_fast_path_matches_the_registered_op(device, monkeypatch):
    """The public functions' eager fast path (one autograd.Function over the ops' implementations)
    gives the registered op's values and gradients bit for bit, and is the path a plain eager
    call takes: no fused:: op is dispatched. Under a dispatch mode the op is dispatched."""
    def no_grad_outputs(fn, args, kwargs):
        with torch.no_grad():
            out = getattr(torch_fused, fn)(*args, **kwargs)
        return out if isinstance(out, tuple) else (out,)

    for fn, args, kwargs in _fast_path_cases(device):
        fast = _outputs_and_grads(fn, args, kwargs) + no_grad_outputs(fn, args, kwargs)
        monkeypatch.setattr(torch_fused, "_eager_eligible", lambda *a: False)
        slow = _outputs_and_grads(fn, args, kwargs) + no_grad_outputs(fn, args, kwargs)
        monkeypatch.undo()
        assert len(fast) == len(slow)
        for a, b in zip(fast, slow):
            assert torch.equal(a, b), fn
        with _SeenOps() as mode:
            getattr(torch_fused, fn)(*args, **kwargs)
        assert mode.seen and mode.seen[0] == "_logprobs_entropy_forward", mode.seen
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            getattr(torch_fused, fn)(*args, **kwargs)
        names = {e.name for e in prof.events()}
        assert f"fused::{fn}" in names and "fused::_logprobs_entropy_forward" not in names, names


def test_eager_fast_path_is_taken_only_where_nothing_needs_the_op():
    from torch_fused._library import eager_eligible

    x = torch.randn(2, 5)
    assert eager_eligible(x, None)
    assert not eager_eligible(x, torch.nn.Parameter(torch.randn(2)))  # a subclass
    with torch.device("cpu"):  # a torch-function mode
        assert not eager_eligible(x)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False):  # a dispatch mode
        assert not eager_eligible(x)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not eager_eligible(x)
    seen = []
    torch.vmap(lambda r: seen.append(eager_eligible(r)) or r)(x)
    assert seen == [False]
    compiled = torch.compile(lambda t: t * 2 if eager_eligible(t) else t * 3, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), x * 3)


@pytest.mark.parametrize("path", ["fast", "op"])
def test_double_backward_raises_on_both_paths(path, monkeypatch):
    """Neither path is twice differentiable: create_graph=True and a second backward raise
    instead of returning a wrong second derivative."""
    if path == "op":
        monkeypatch.setattr(torch_fused, "_eager_eligible", lambda *a: False)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 7, (3,))
    lp, ent = torch_fused.logprobs_and_entropy(x, idx)
    (gx,) = torch.autograd.grad((lp + ent).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gx.sum(), x)
    # also beside a differentiable term: a second derivative silently taken as zero is wrong
    with pytest.raises(RuntimeError):
        torch.autograd.grad((gx * gx).sum() + (x * x).sum(), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["selective", "entropy", "both"])
def test_create_graph_gives_the_first_derivative_on_the_fast_path(which, device, monkeypatch):
    """create_graph=True on the eager fast path: the same first derivative as a plain backward,
    for each public function, and a second backward raises. The node keeps only the outputs the
    function returns (the Triton forward makes no entropy for selective_log_softmax); the
    registered backward op it calls here still gets a tensor for each Tensor of its schema (some
    torch versions accept a None there, others raise)."""
    op = torch.ops.fused._logprobs_entropy_backward
    required = [i for i, a in enumerate(op.default._schema.arguments) if str(a.type) == "Tensor"]
    calls = []

    def checked(*args, **kwargs):
        calls.append([i for i in required if not isinstance(args[i], torch.Tensor)])
        return op(*args, **kwargs)

    monkeypatch.setattr(torch.ops.fused, "_logprobs_entropy_backward", checked)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, generator=g).to(device).requires_grad_(True)
    idx = torch.randint(0, 9, (4,), generator=g).to(device)
    f = {"selective": lambda: torch_fused.selective_log_softmax(x, idx),
         "entropy": lambda: torch_fused.entropy_from_logits(x),
         "both": lambda: sum(torch_fused.logprobs_and_entropy(x, idx))}[which]
    (ref,) = torch.autograd.grad(f().sum(), x)
    (gx,) = torch.autograd.grad(f().sum(), x, create_graph=True)
    torch.testing.assert_close(gx, ref)
    assert calls == [[]], f"calls of the backward op, positions of a required Tensor not given one: {calls}"
    # d logits is a node of the graph (made by the registered backward op), whose own backward raises
    assert gx.grad_fn is not None
    with pytest.raises(RuntimeError, match="autograd"):
        torch.autograd.grad(gx.sum(), x)


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_shift_of_the_wrong_type_names_the_argument(bad):
    x = torch.randn(2, 3, 5)
    i = torch.zeros(2, 2, dtype=torch.long)
    for call in (lambda: torch_fused.selective_log_softmax(x, i, shift=bad),
                 lambda: torch_fused.entropy_from_logits(x, shift=bad),
                 lambda: torch_fused.logprobs_and_entropy(x, i, shift=bad),
                 lambda: torch_fused.linear_logprobs_and_entropy(torch.randn(2, 3, 4), torch.randn(5, 4), i, shift=bad)):
        with pytest.raises(TypeError, match=r"shift: expected a bool, got " + repr(bad)):
            call()


@pytest.mark.parametrize("device", DEVICES)
def test_fast_path_differentiates_a_temperature_alone(device, monkeypatch):
    """Logits that need no gradient and a temperature that does: the temperature's gradient
    arrives on the fast path, equal to the registered op's."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 11, generator=g).to(device)
    idx = torch.randint(0, 11, (3,), generator=g).to(device)

    def grad_t():
        t = torch.tensor(0.9, device=device, requires_grad=True)
        lp, ent = torch_fused.logprobs_and_entropy(x, idx, temperature=t)
        return torch.autograd.grad((lp * 0.7 + ent).sum(), t)[0]

    fast = grad_t()
    monkeypatch.setattr(torch_fused, "_eager_eligible", lambda *a: False)
    assert torch.equal(fast, grad_t()) and fast != 0


@pytest.mark.parametrize("device", DEVICES)
def test_merge_shift_is_the_kernels_rounded_difference(device):
    """The shift difference of the GPU path (the vocabulary-parallel merge's, the fused head's), round(a c) - round(b c) in fp32, is bitwise the fp32
    products' difference in eager, and the same under torch.compile: no product fused into the
    subtraction (an fma would be off by up to half an ulp of a c, ~5e-4 at |a c| ~ 1.4e4; the
    CPU's inductor code does not fuse, CUDA's Triton code did, even of fp64 products cast back
    to fp32)."""
    from torch_fused.ops.logprobs import shift_difference as _shift

    g = torch.Generator().manual_seed(0)
    a = (torch.randn(4, 4096, generator=g) * 1e4).to(device)
    b = a.amax(0)
    c = 1.4426950408889634 / 0.7
    want = a * c - b * c  # fp32 products, each rounded, then the difference
    assert torch.equal(_shift(a, b, c, False), want)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: _shift(x, y, c, False), fullgraph=True)
    assert torch.equal(compiled(a, b), want)
    torch.library.opcheck(torch.ops.fused._merge_shift, (a, b, c))
    # the inputs tell the two forms apart: the unrounded product's difference is not the same
    c32 = float(torch.tensor(c, dtype=torch.float32))
    assert not torch.equal(((a.double() - b.double()) * c32).float(), want)


def _plan_cases(device):
    """Calls that share shapes but differ in one thing a launch plan depends on: the logits'
    strides (contiguous, leading dims transposed, a strided vocabulary that needs a copy), dtype,
    shift, temperature, ignore_index, index layout (contiguous or not, K ids), the entropy."""
    g = torch.Generator().manual_seed(11)
    b, l, v = 2, 3, 40
    full = make_logits((b, l + 1), v, torch.float32, device, "contiguous", gen=g)
    wide = make_logits((b, l), 2 * v, torch.float32, device, "contiguous", gen=g)
    idx = torch.randint(0, v, (b, l), generator=g).to(device)
    idx_t = torch.randint(0, v, (l, b), generator=g).to(device).t()  # [b, l], not contiguous
    idxk = torch.randint(0, v, (b, l, 2), generator=g).to(device)
    contig = full[:, :-1].contiguous()
    return [
        ("contiguous", contig, idx, {}),
        ("sliced view", full[:, :-1], idx, {}),
        ("leading dims transposed", contig.transpose(0, 1).contiguous().transpose(0, 1), idx, {}),
        ("vocabulary strided", wide[..., ::2], idx, {}),
        ("bf16", contig.bfloat16(), idx, {}),
        ("shift", full, idx, {"shift": True}),
        ("temperature", contig, idx, {"temperature": 0.7}),
        ("ignore_index", contig, idx, {"ignore_index": int(idx[0, 0])}),
        ("index not contiguous", contig, idx_t, {}),
        ("K ids", contig, idxk, {}),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_with_another_layout_never_reuse_a_plan(device):
    """The Triton implementations keep a launch plan per call key (ops/logprobs.py, _FWD_PLANS /
    _BWD_PLANS). Each case shares its shapes with the others and differs in one thing the plan
    depends on; two rounds over all of them, so the second round's calls all find their plans,
    and every output and logits gradient (upstream gradients contiguous, expanded and strided,
    three backward calls of one forward) against the float64 formulas."""
    from _helpers import assert_grad_close, assert_logprob_close, ref_logprobs_entropy

    cases = _plan_cases(device)
    for _ in range(2):
        for what, x, index, kw in cases:
            t = kw.get("temperature", 1.0)
            ig = kw.get("ignore_index", -100)
            live = x[:, :-1] if kw.get("shift") else x
            xr = live.detach().double().cpu().requires_grad_(True)
            rlp, rent = ref_logprobs_entropy(xr, index.cpu(), t, ig)
            xg = x.detach().clone().requires_grad_(True)
            lp, ent = torch_fused.logprobs_and_entropy(xg, index, **kw)
            assert_logprob_close(lp, rlp, x.shape[-1], f"{what}: log-probs", x.dtype)
            assert_logprob_close(ent, rent, x.shape[-1], f"{what}: entropy", x.dtype)
            for gname in ("contiguous", "expanded", "strided"):
                if gname == "expanded":
                    g_lp, g_ent = torch.ones_like(lp).expand_as(lp), None
                elif gname == "strided":
                    g_lp = torch.randn(lp.shape + (2,), dtype=lp.dtype, device=device)[..., 0]
                    g_ent = torch.randn(ent.shape + (2,), dtype=ent.dtype, device=device)[..., 1]
                else:
                    g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
                outs, grads = (lp,) if g_ent is None else (lp, ent), (g_lp,) if g_ent is None else (g_lp, g_ent)
                (dx,) = torch.autograd.grad(outs, xg, grads, retain_graph=True)
                routs = (rlp,) if g_ent is None else (rlp, rent)
                (rdx,) = torch.autograd.grad(routs, xr, tuple(gr.double().cpu() for gr in grads), retain_graph=True)
                if kw.get("shift"):
                    assert bool((dx[:, -1] == 0).all()), f"{what}: the dropped position's gradient"
                    dx = dx[:, :-1]
                scale = g_lp.abs().double().cpu().reshape(rlp.shape[:2] + (-1,)).sum(-1, keepdim=True)
                if g_ent is not None:
                    scale = scale + g_ent.abs().double().cpu()[..., None]
                assert_grad_close(dx, rdx, scale / t, x.dtype, f"{what}: d logits, {gname} upstream gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_saved_tensor_hooks_that_change_the_saved_layout(device):
    """A saved-tensor hook (torch.autograd.graph.save_on_cpu, an activation offloader) may hand
    the backward a copy of the logits in another layout than the forward's: a contiguous copy of
    a sliced ``[:, :-1]`` view, or a transposed-storage copy of contiguous logits (and of the
    saved row statistics, which the backward kernel reads as contiguous rows). The eager path's
    backward plans, kept per forward plan, must not reuse one layout's plan for the other: the
    same forward key with and without the hook, in both orders, against float64."""
    from _helpers import assert_grad_close, ref_logprobs_entropy

    g = torch.Generator().manual_seed(7)
    base = torch.randn(3, 7, 50, generator=g).to(device)
    index = torch.randint(0, 50, (3, 6), generator=g).to(device)
    upstream = torch.randn(3, 6, generator=g).to(device)
    packs = {
        "contiguous copy of a slice": (lambda t: t.contiguous().clone() if t.dim() == 3 else t, True),
        "transposed-storage copy (logits and row statistics)": (
            lambda t: t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() == 3 else t, False),
    }
    for what, (pack, sliced) in packs.items():
        for order in ((True, False), (False, True)):
            for hooked in order:
                x = base.clone().requires_grad_(True)
                logits = x[:, :-1] if sliced else x[:, :6]
                if not sliced:
                    logits = logits.contiguous()
                if hooked:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        lp = torch_fused.selective_log_softmax(logits, index)
                else:
                    lp = torch_fused.selective_log_softmax(logits, index)
                (dx,) = torch.autograd.grad(lp, x, upstream)
                xr = base.double().cpu().requires_grad_(True)
                rlp, _ = ref_logprobs_entropy(xr[:, :6], index.cpu(), 1.0)
                (rdx,) = torch.autograd.grad(rlp, xr, upstream.double().cpu())
                scale = upstream.abs().double().cpu()[..., None]
                assert_grad_close(dx[:, :6], rdx[:, :6], scale, torch.float32,
                                  f"{what}, hook {'on' if hooked else 'off'} (order {order})")
                assert bool((dx[:, 6:] == 0).all()), f"{what}: the rows outside the logits"


def test_plan_launch_keys_compiled_kernels_by_alignment_and_device(monkeypatch, settings_override):
    """_library.PlanLaunch with settings.direct_launch: the first call per (device, pointer
    alignments) goes through kernel[grid] and keeps its compiled kernel; a later call with the
    same alignments calls that kernel's launcher with the positional arguments and the
    constexpr parameters in signature order; another alignment or device goes through
    kernel[grid] again; launches traced by inline_under_compile never go direct."""
    from torch_fused import _library

    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            calls.append(("direct",) + a)

    class Kernel:
        arg_names = ["p", "q", "n", "A", "B"]

        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append(("grid", grid, args, kw))
                return Compiled()
            return launch

    device = [0]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: device[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 100 + d, raising=False)
    settings_override(direct_launch=True)
    go = _library.PlanLaunch(Kernel(), dict(B=2, A=1, num_warps=4), interpret=False)
    with pytest.raises(ValueError, match="not the signature's last"):  # a keyword parameter mid-signature
        _library.PlanLaunch(Kernel(), dict(n=3, A=1), interpret=False)
    buf = torch.zeros(64)
    p, q, odd = buf[:8], buf[16:24], buf[1:9]  # 4-byte elements: buf[1:] is not 16-byte aligned
    go(5, p, q, 7)
    go(5, p, q, 7)
    assert calls[0] == ("grid", (5,), (p, q, 7), dict(B=2, A=1, num_warps=4))
    assert calls[1][:10] == ("direct", 5, 1, 1, 100, "fn", "meta", None, None, None)
    assert calls[1][10:13] == (p, q, 7) and calls[1][13:] == (1, 2)  # A, B in signature order
    go(5, odd, q, 7)  # another alignment: its own compiled kernel
    assert calls[2][0] == "grid"
    device[0] = 1
    go(5, p, q, 7)  # another device
    assert calls[3][0] == "grid"
    go(5, p, q, 7)
    assert calls[4][:5] == ("direct", 5, 1, 1, 101)
    settings_override(direct_launch=False)
    go(5, p, q, 7)
    assert calls[5][0] == "grid"
    settings_override(direct_launch=True)
    monkeypatch.setattr(_library, "_launch_hooks_set", lambda: True)  # a profiler's launch hooks
    go(5, p, q, 7)
    assert calls[6][0] == "grid"
    monkeypatch.setattr(_library, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(_library._INLINE, "active", True)
    monkeypatch.setattr(torch.library, "wrap_triton", lambda k: k)
    go(5, p, q, 7)
    assert calls[7][0] == "grid"


def test_launch_hooks_are_seen_on_the_installed_triton():
    """A launch hook set the way a profiler sets it (Triton's own hook object) turns the direct
    launch off: ``_launch_hooks_set`` reads the live hooks of the installed Triton, not a stale copy."""
    triton = pytest.importorskip("triton")
    from torch_fused import _library

    assert not _library._launch_hooks_set()
    if getattr(triton, "knobs", None) is None:  # older Triton: a plain attribute of CompiledKernel
        where = triton.compiler.CompiledKernel
        old = getattr(where, "launch_enter_hook", None)
        where.launch_enter_hook = lambda *a: None
        try:
            assert _library._launch_hooks_set()
        finally:
            where.launch_enter_hook = old
        return
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):  # a plain attribute
        triton.knobs.runtime.launch_enter_hook = lambda *a: None
        try:
            assert _library._launch_hooks_set()
        finally:
            triton.knobs.runtime.launch_enter_hook = chain
        return
    hook = lambda *a: None  # noqa: E731
    chain.add(hook)
    try:
        assert _library._launch_hooks_set()
    finally:
        chain.remove(hook)
    assert not _library._launch_hooks_set()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float64_temperature_gradient_is_computed_in_float64(device, dtype):
    """d T of a float64 tensor temperature is computed and returned in float64 whatever the logits'
    dtype: at T = 1e-20 the true gradient is about 7e40 (fp32 gave inf), at T = 1e30 about 3e-60
    (fp32 gave 0). Compared with the float64 formula on the same (rounded) logits."""
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(3, 7, generator=g).to(dtype)
    idx = x0.float().argmin(-1)  # the least likely id: its log-prob moves as (x_min - x_max) / T
    for value in (1e-20, 1e30):
        x = x0.to(device).requires_grad_(True)
        t = torch.tensor(value, dtype=torch.float64, device=device, requires_grad=True)
        (dt,) = torch.autograd.grad(torch_fused.selective_log_softmax(x, idx.to(device), temperature=t).sum(), t)
        tr = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        want = torch.autograd.grad(torch.log_softmax(x0.double() / tr, -1).gather(-1, idx[:, None]).sum(), tr)[0]
        assert dt.dtype == torch.float64 and math.isfinite(dt.item()) and dt.item() != 0.0, (value, dt)
        assert abs(dt.item() - want.item()) <= 1e-5 * abs(want.item()), (value, dt.item(), want.item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy"])
def test_shift_backward_with_an_empty_leading_dim(device, fn):
    """shift=True with a size-0 dim among three or more leading dims: an empty gradient of the
    logits' shape (the kernel path's layout of d logits' rows failed to unpack there)."""
    call = getattr(torch_fused, fn)
    for shape in ((2, 0, 4, 20), (0, 3, 5, 20), (2, 3, 0, 1, 20)):
        x = torch.randn(shape, device=device, requires_grad=True)
        idx = torch.zeros(shape[:-2] + (shape[-2] - 1,), dtype=torch.long, device=device)
        out = call(x, shift=True) if fn == "entropy_from_logits" else call(x, idx, shift=True)
        out = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in out).backward()
        assert x.grad.shape == x.shape


def test_tensor_temperature_without_grad_takes_the_segmented_backward(settings_override):
    """A tensor temperature that requires no grad computes no d T partials: the backward op asked
    for no d T returns an empty one and the same d logits, and on the Triton path its plan has
    HAS_DT off and splits rows into segments as a float temperature's does (with d T: one program
    per row, HAS_DT on)."""
    from torch_fused.ops import logprobs as lp_ops

    settings_override(logprobs_bwd_segment=48)
    g = torch.Generator().manual_seed(3)
    v = 200
    x = torch.randn(2, 3, v, generator=g)
    idx = torch.randint(0, v, (2, 3), generator=g)
    t = torch.tensor(0.8)
    stats = OPS._logprobs_entropy_forward(x, idx, t, 1.0, -100, False, False)[2]
    gl = torch.randn(2, 3, generator=g)
    results = {}
    for want in (False, True):
        lp_ops._BWD_PLANS.clear()
        results[want] = OPS._logprobs_entropy_backward(gl, None, x, idx, stats, torch.empty(0), t, 1.0, -100, False,
                                                       False, temperature_grad=want)
        assert results[want][1].shape == (() if want else (0,)), (want, results[want][1].shape)
        if torch_fused._library.on_triton(x):
            ((plan, _),) = lp_ops._BWD_PLANS.values()
            constexprs, segs = plan[5], plan[4][17]
            assert constexprs["HAS_DT"] is want and constexprs["T_FROM_PTR"], constexprs
            assert segs == (1 if want else 5), segs  # 200 columns in segments of 48
    torch.testing.assert_close(results[False][0], results[True][0], rtol=0, atol=0)
    xr = x.double().requires_grad_(True)
    want_dx = torch.autograd.grad((torch.log_softmax(xr / 0.8, -1).gather(-1, idx[..., None])[..., 0] * gl).sum(),
                                  xr)[0]
    torch.testing.assert_close(results[False][0].double(), want_dx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shift", [False, True])
def test_slice_backward_op_is_the_backward_on_a_vocabulary_slice(device, shift):
    """fused::_logprobs_entropy_slice_backward (the vocabulary-parallel local backward, one opaque op
    under torch.compile): with the whole rows' stats and entropy, a slice's d logits are the whole
    backward's columns; opcheck on it."""
    g = torch.Generator().manual_seed(9)
    v = 37
    x = torch.randn(2, 4, v, generator=g).to(device)
    idx = torch.randint(0, v, (2, 3 if shift else 4, 2), generator=g).to(device)
    lp, ent, stats = OPS._logprobs_entropy_forward(x, idx, None, 0.7, -100, True, shift)
    gl, ge = torch.randn(lp.shape, generator=g).to(device), torch.randn(ent.shape, generator=g).to(device)
    dx, _ = OPS._logprobs_entropy_backward(gl, ge, x, idx, stats, ent, None, 0.7, -100, True, shift)
    for lo, hi in ((0, 10), (10, 37)):
        args = (gl, ge, x[..., lo:hi].contiguous(), idx, stats, ent, 0.7, -100, True, shift)
        kw = dict(v_off=lo, v_total=v)
        part = OPS._logprobs_entropy_slice_backward(*args, **kw)
        torch.testing.assert_close(part, dx[..., lo:hi], rtol=1e-5, atol=1e-6)
        torch.library.opcheck(OPS._logprobs_entropy_slice_backward, args, kw)
