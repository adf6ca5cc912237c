"""Where the host time of a small eager call goes (CUDA): wall time per call of the pieces of the
public log-prob path; the public forward+backward beside the empty-kernel autograd.Function floor,
with and without the autograd engine's device thread, with the kernel launches stubbed out, cut to
one program or made another way (tensor addresses, torch's static CUDA launcher); and cProfile /
torch.profiler summaries. Writes $OUT/host_profile.txt."""
import cProfile, io, os, pstats
import torch
import torch_fused
from torch_fused.ops import logprobs as L
from torch_fused.kernels import logprobs as K
from torch_fused import _library as LIB
from torch_fused.bench.small import wall_us, wall_us_rounds, _empty_op

out = open(os.path.join(os.environ.get("OUT", "."), "host_profile.txt"), "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); out.write(s + "\n"); out.flush()

n, v = 64, 1024
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
xg = x.detach().requires_grad_(True)
idx = torch.randint(0, v, (n,), device="cuda", generator=g)
empty, empty_function = _empty_op()

def fb(f):
    return lambda: torch.autograd.grad(f(xg).sum(), xg)[0]

class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t): return t.view_as(t)
    @staticmethod
    def backward(ctx, gr): return gr

class Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t): return t * 2
    @staticmethod
    def backward(ctx, gr): return gr * 2

logp, ent, stats = L._forward_triton(x, idx, None, 1.0, -100, False, False)
gl = torch.ones_like(logp)
c = 1.4426950408889634
bv, w = K.pick_block(v, 2, "fwd")
args = (x, idx.reshape(n, 1), logp, None, stats, None, None, None, v, 1, n, 0, v, c, -100, 0)
kw = dict(HAS_INDEX=True, HAS_ENT=False, EXACT_SHIFT=False, T_FROM_PTR=False, HAS_TAU=False, HAS_SUP=False, BLOCK_V=bv,
          BLOCK_K=2, EPT=8, num_warps=w)
launch = lambda: K._logprobs_entropy_forward_kernel[(n,)](*args, **kw)
# the same launch through the compiled kernel's own launcher, Triton's argument binding and cache
# lookup (done once here) left out: what a launch plan holding the compiled kernel would pay
_ck = launch()
_all = list(args) + [kw[k] for k in K._logprobs_entropy_forward_kernel.arg_names[len(args):]]
_stream = torch.cuda.current_stream().cuda_stream
direct = lambda: _ck.run(n, 1, 1, _stream, _ck.function, _ck.packed_metadata, None, None, None, *_all)
core = torch.ops.fused._logprobs_entropy_forward
cases = [
    ("torch.empty x3", lambda: (torch.empty(64, device="cuda"), torch.empty(0, device="cuda"), torch.empty(64, 2, device="cuda"))),
    ("x * 2 (one torch op)", lambda: x * 2),
    ("bare triton launch, fwd kernel", launch),
    ("the same, compiled kernel's launcher called directly", direct),
    ("core op (dispatcher), no grad", lambda: core(x, idx, None, 1.0, -100, False, False)),
    ("_forward_triton", lambda: L._forward_triton(x, idx, None, 1.0, -100, False, False)),
    ("backward_triton", lambda: L.backward_triton(gl, None, x, idx, stats, ent, None, L.Options(1.0, -100, True, False))),
    ("public fwd", lambda: torch_fused.selective_log_softmax(x, idx)),
    ("torch formula fwd", lambda: torch.log_softmax(x.float(), -1).gather(-1, idx[:, None])),
    ("empty op fwd", lambda: empty(x, idx)),
    ("grad of xg * 2 (C++ node)", fb(lambda t: t * 2)),
    ("grad of Ident (python node, view)", fb(Ident.apply)),
    ("grad of Mul (python node)", fb(Mul.apply)),
    ("torch formula fwd+bwd", fb(lambda t: torch.log_softmax(t.float(), -1).gather(-1, idx[:, None]))),
    ("public fwd+bwd", fb(lambda t: torch_fused.selective_log_softmax(t, idx))),
    ("public fwd+bwd, .backward()", lambda: torch_fused.selective_log_softmax(xg, idx).sum().backward()),
    ("empty op fwd+bwd", fb(lambda t: empty(t, idx))),
]
for name, f in cases:
    say(f"{name:40s} {wall_us(f):8.1f} us")
with torch.autograd.set_multithreading_enabled(False):
    for name, f in cases[-7:]:
        say(f"[autograd multithreading off] {name:40s} {wall_us(f):8.1f} us")
# the public fwd+bwd above the empty-kernel autograd.Function floor: how much of the gap the
# autograd engine's device thread adds (multithreading off runs the backward on this thread) and
# how much the two kernel launches cost (stubbed: no kernel runs, the outputs are garbage), and
# whether it is their host time or their device time (one program per launch; a device sleep)
_real_launch = LIB.PlanLaunch.__call__
_launch_variants = {
    "all": lambda self, grid, *a: None,  # no launch
    "fwd": lambda self, grid, *a: None if "forward" in self.kernel.fn.__name__ else _real_launch(self, grid, *a),
    "bwd": lambda self, grid, *a: None if "backward" in self.kernel.fn.__name__ else _real_launch(self, grid, *a),
    "grid1": lambda self, grid, *a: _real_launch(self, 1, *a),  # the same launches, one program each
}


# the same launches through torch's static CUDA launcher (Inductor's, private: cuLaunchKernel with
# the arguments parsed in C++) instead of Triton's (cuLaunchKernelEx): the kernel Triton compiled
# and loaded, its non-constexpr arguments only
_TY = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H", "u32": "I",
       "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}
_STATIC = {}


def _static_plan(ck, n_args):
    names = ck.src.fn.arg_names
    sig = {(names[k] if isinstance(k, int) else k): v for k, v in ck.src.signature.items()}
    consts = {names[k] if isinstance(k, int) else k
              for k in ((c[0] if isinstance(c, tuple) else c) for c in (getattr(ck.src, "constants", None) or {}))}
    keep, tys = [], []
    for i, name in enumerate(names):
        if sig[name] == "constexpr" or name in consts:
            continue
        assert i < n_args, name
        keep.append(i)
        tys.append("O" if sig[name].startswith("*") else _TY[sig[name]])
    md = ck.metadata
    scratch = [a for a in ("global_scratch_size", "profile_scratch_size") if hasattr(md, a)]
    assert all(getattr(md, a) == 0 for a in scratch) and getattr(md, "num_ctas", 1) == 1
    return ck.function, md.num_warps, md.shared, tuple(keep), "".join(tys) + "O" * len(scratch), (None,) * len(scratch)


def _static_launch(self, grid, *args):
    if self.tensor_slots is None:
        return _real_launch(self, grid, *args)
    device = torch._C._cuda_getDevice()
    key = (id(self), device, *[args[i].data_ptr() % 16 == 0 for i in self.tensor_slots])
    plan = _STATIC.get(key)
    if plan is None:
        _STATIC[key] = _static_plan(self.kernel[(grid,)](*args, **self.constexprs), len(args))
        return
    function, warps, shared, keep, tys, pad = plan
    torch._C._StaticCudaLauncher._launch_kernel(function, grid, 1, 1, warps, shared, tys,
                                                tuple(args[i] for i in keep) + pad,
                                                torch._C._cuda_getCurrentRawStream(device))


if hasattr(torch._C, "_StaticCudaLauncher"):
    _launch_variants["static"] = _static_launch


# the direct launch with each tensor passed as its address (an int): Triton's launcher then skips
# its per-pointer data_ptr() call and cuPointerGetAttribute check
def _int_pointer_launch(self, grid, *args):
    slots = self.tensor_slots
    if slots is None:
        return _real_launch(self, grid, *args)
    device = torch._C._cuda_getDevice()
    ptrs = [args[i].data_ptr() for i in slots]
    hit = self.compiled.get((device, *[p % 16 == 0 for p in ptrs]))
    if not hit:
        return _real_launch(self, grid, *args)
    run, function, metadata, tail = hit
    args = list(args)
    for i, p in zip(slots, ptrs):
        args[i] = p
    run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None, *args, *tail)


_launch_variants["intptr"] = _int_pointer_launch


def stubbed(f, which="all"):
    def call():
        LIB.PlanLaunch.__call__ = _launch_variants[which]
        try:
            return f()
        finally:
            LIB.PlanLaunch.__call__ = _real_launch
    return call


# whether device time leaks into the host time of a fwd+bwd: a node that launches nothing, and the
# same node keeping the device busy (torch.cuda._sleep, one cudaLaunchKernel) each way
def _sleep_cycles_per_us():
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    e0.record(); torch.cuda._sleep(1_000_000); e1.record(); torch.cuda.synchronize()
    return 1_000_000 / (e0.elapsed_time(e1) * 1000)


_CYC_PER_US = _sleep_cycles_per_us()


class Sleeper(torch.autograd.Function):
    us = 0

    @staticmethod
    def forward(ctx, t, ids):
        if Sleeper.us:
            torch.cuda._sleep(int(Sleeper.us * _CYC_PER_US))
        ctx.save_for_backward(t)
        return ids.new_empty(ids.shape, dtype=torch.float32)

    @staticmethod
    def backward(ctx, gr):
        (t,) = ctx.saved_tensors
        if Sleeper.us:
            torch.cuda._sleep(int(Sleeper.us * _CYC_PER_US))
        return torch.empty_like(t), None


def sleeping(f, us):
    def call():
        Sleeper.us = us
        try:
            return f()
        finally:
            Sleeper.us = 0
    return call

def no_mt(f):
    def call():
        with torch.autograd.set_multithreading_enabled(False):
            return f()
    return call

for n_, v_ in ((64, 1024), (512, 32000)):
    xs = torch.randn(n_, v_, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    ids = torch.randint(0, v_, (n_,), device="cuda", generator=g)
    fbs = lambda f: (lambda: torch.autograd.grad(f(xs).sum(), xs)[0])
    pub = fbs(lambda t: torch_fused.selective_log_softmax(t, ids))
    flo = fbs(lambda t: empty_function(t, ids))
    tor = fbs(lambda t: torch.log_softmax(t.float(), -1).gather(-1, ids[:, None]))
    nol = fbs(lambda t: Sleeper.apply(t, ids))
    rows = [("torch formula", tor), ("public", pub), ("public, launches stubbed", stubbed(pub)),
            ("public, forward launch stubbed", stubbed(pub, "fwd")),
            ("public, backward launch stubbed", stubbed(pub, "bwd")),
            ("public, each launch one program (no device work)", stubbed(pub, "grid1")),
            ("empty-kernel autograd.Function", flo), ("no-launch autograd.Function", nol),
            ("no-launch autograd.Function + 20 us device sleep each way", sleeping(nol, 20))]
    rows.append(("public, pointers passed as ints", stubbed(pub, "intptr")))
    if "static" in _launch_variants:
        rows.append(("public, torch's static CUDA launcher", stubbed(pub, "static")))
    ref = pub()
    for which in ("intptr", "static"):
        if which in _launch_variants:
            for _ in range(2):  # the first call of a plan launches through kernel[grid]
                got = stubbed(pub, which)()
            say(f"[{n_}, {v_}] {which} launches give the same d logits: {torch.equal(got, ref)}")
    rows += [(name + ", multithreading off", no_mt(f)) for name, f in rows]
    for (name, _), t in zip(rows, wall_us_rounds([f for _, f in rows])):
        say(f"[{n_}, {v_}] fwd+bwd, {name:50s} {t:8.1f} us")
for name, f in (("public fwd+bwd", fb(lambda t: torch_fused.selective_log_softmax(t, idx))),
                ("grad of Mul (python node)", fb(Mul.apply))):
    s = io.StringIO()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): f()
    torch.cuda.synchronize(); pr.disable()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    say("cProfile (main thread) 300 x", name); say(s.getvalue())
from torch.profiler import profile, ProfilerActivity
f = fb(lambda t: torch_fused.selective_log_softmax(t, idx))
for _ in range(20): f()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(50): f()
    torch.cuda.synchronize()
say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))

# compiled GRPO loss
from torch_fused.bench.small import grpo_loss, plain_both
old = torch.randn(n, device="cuda") - 5; adv = torch.randn(n, device="cuda"); mask = torch.ones(n, device="cuda")
def grpo(name, fn):
    cf = torch.compile(grpo_loss(fn), fullgraph=True)
    call = lambda: torch.autograd.grad(cf(xg, idx, old, adv, mask), xg)[0]
    say(f"compiled GRPO {name}: {wall_us(call):.1f} us")
    s = io.StringIO(); pr = cProfile.Profile(); pr.enable()
    for _ in range(200): call()
    torch.cuda.synchronize(); pr.disable()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    say(s.getvalue())
grpo("plain", plain_both)
grpo("ours", torch_fused.logprobs_and_entropy)
