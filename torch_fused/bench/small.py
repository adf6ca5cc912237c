"""Small and mid-sized calls: the public log-prob / entropy functions against torch's own formula,
wall time per call, eager and compiled.

At [64, 1024] a call is host-bound: the time is the Python and dispatch path, not the kernel.
Each row is the wall time per call of ``CALLS`` calls back to back (one synchronize at the end),
so a host-bound call is timed by its host path and a device-bound one by its kernels, as a
training loop sees them. The rows of one shape are timed in rounds (each row once per round, the
median of 9 rounds): the host's speed drifts by tens of percent over a run, and a ratio of two
rows timed minutes apart would carry that drift. A ratio is the median over the rounds of the
two rows' ratio within a round, reported with its lowest and highest: where that range spans 1,
the host's noise alone can put either side ahead. Rows:

- eager forward and forward+backward of each public function beside the plain formula
  (``log_softmax(x.float())`` gathered, ``-(p * log p).sum``), and the raw op
  (``torch.ops.fused.*``: the same kernels with the public function's argument handling left out);
- the floors of the two registrations, at every shape: a custom op registered as the log-prob
  ops are (a ``torch.library.custom_op`` core with a registered CUDA kernel, a fake and an
  autograd formula, under a ``CompositeImplicitAutograd`` public op: the raw op's path), and a
  ``torch.autograd.Function`` (the public functions' eager path; fwd+bwd rows), each launching
  one empty Triton kernel forward and one backward the way the ops launch theirs
  (``_library.PlanLaunch``) and allocating only their outputs: what a call costs before any
  work of its own;
- a small GRPO-style loss (log-probs and entropy of the sampled ids, the clipped ratio against old
  log-probs times advantages, an entropy bonus, a masked mean) forward+backward under
  ``torch.compile(fullgraph=True)``, against the same formula in plain PyTorch compiled the same way,
  and once more compiled with Inductor's ``static_launch_user_defined_triton_kernels`` (the
  log-prob kernels, which the graph launches itself, then go through Inductor's static launcher
  as its own kernels do; torch's default leaves it off);
- the same loss compiled with ``mode="reduce-overhead"`` (Inductor's CUDA graphs), ours beside the
  plain formula's, and the eager ``selective_log_softmax`` forward+backward captured in one CUDA
  graph (``torch.cuda.graph``) beside torch's formula captured the same way: a call is then one
  graph replay, so these rows compare the device work that the host-bound rows above hide.

The ``ratio`` column is ours over torch's formula (below 1: we are faster). The memory floor of
the larger shapes (fraction of floor) is in the logprobs suite; this suite is about the calls
where it is not the limit.
"""

from __future__ import annotations

import time

import torch

import torch_fused

from . import common
from .common import Row
from .logprobs import plain_entropy, plain_selective

SHAPES = [(64, 1024), (512, 4096), (512, 32000), (4096, 32000)]
CALLS = 200
ROUNDS = 9


def wall_us(fn, calls: int = CALLS) -> float:
    """Wall microseconds per call of fn over `calls` calls back to back (the median of ROUNDS such
    runs), warm."""
    return wall_us_rounds([fn], calls)[0]


def wall_us_rounds(fns, calls: int = CALLS, rounds: int = ROUNDS) -> list[float]:
    """wall_us of each of fns, timed in rounds (every fn once per round, in turn), so that a
    slower or faster spell of the host falls on all of them alike: the median over the rounds
    of each fn's wall microseconds per call over `calls` calls back to back, warm."""
    return [median(r) for r in wall_us_runs(fns, calls, rounds)]


def wall_us_runs(fns, calls: int = CALLS, rounds: int = ROUNDS) -> list[list[float]]:
    """Each of fns' wall microseconds per call in every round (one list per fn, one entry per
    round), the fns timed in turn within a round after a warm-up of 20 calls each."""
    for fn in fns:
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    runs = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, runs):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t0) / calls * 1e6)
    return runs


def median(values):
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def paired_ratio(ours, base):
    """(median, min, max) over the rounds of ours / base within each round: a ratio of two calls
    timed seconds apart, and its spread, which shows how much of a difference the host's noise
    alone makes."""
    r = [a / b for a, b in zip(ours, base)]
    return median(r), min(r), max(r)


def plain_both(logits, index):
    lp = torch.log_softmax(logits.float(), -1)
    return lp.gather(-1, index[..., None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


def grpo_loss(logprobs_and_entropy):
    """A GRPO-style token loss over one call of ``logprobs_and_entropy(logits, ids)``."""
    def loss(logits, ids, old_logp, adv, mask):
        logp, ent = logprobs_and_entropy(logits, ids)
        ratio = torch.exp(logp - old_logp)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) - 0.01 * ent
        return (per_token * mask).sum() / mask.sum().clamp(min=1)

    return loss


def cuda_graph(fn):
    """A CUDA graph of one call of ``fn`` (warmed up on a side stream, then captured): (its replay,
    the captured call's result, which each replay overwrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def _empty_op():
    """The registration floor: an op registered as the log-prob ops are, whose implementations
    launch one empty kernel and allocate only their outputs."""
    import triton

    from .._library import PlanLaunch

    @triton.jit
    def _empty_kernel(x_ptr, n):
        pass

    # launched as the ops launch theirs (settings.direct_launch applies to it too)
    empty_launch = PlanLaunch(_empty_kernel, {})

    if not hasattr(torch.ops.torch_fused_bench, "_empty_core"):
        @torch.library.custom_op("torch_fused_bench::_empty_core", mutates_args=())
        def core(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            empty_launch(1, x, 0)
            return index.new_empty(index.shape, dtype=torch.float32), index.new_empty((2,), dtype=torch.float32)

        @core.register_fake
        def _(x, index):
            return index.new_empty(index.shape, dtype=torch.float32), index.new_empty((2,), dtype=torch.float32)

        def setup(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        def backward(ctx, g1, g2):
            (x,) = ctx.saved_tensors
            empty_launch(1, x, 0)
            return torch.empty_like(x), None

        core.register_autograd(backward, setup_context=setup)
        lib = torch.library.Library("torch_fused_bench", "FRAGMENT")
        lib.define("empty(Tensor x, Tensor index) -> Tensor")
        lib.impl("empty", lambda x, index: torch.ops.torch_fused_bench._empty_core(x, index)[0],
                 "CompositeImplicitAutograd")
        _LIBS.append(lib)

    class EmptyEager(torch.autograd.Function):
        """The eager path's floor: one autograd.Function, one empty launch each way."""

        @staticmethod
        def forward(ctx, x, index):
            empty_launch(1, x, 0)
            ctx.save_for_backward(x)
            return index.new_empty(index.shape, dtype=torch.float32)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            empty_launch(1, x, 0)
            return torch.empty_like(x), None

    return torch.ops.torch_fused_bench.empty, EmptyEager.apply


_LIBS: list = []  # keeps the bench namespace's Library alive


def _static_user_launch_config():
    """The name of Inductor's config that launches user-defined Triton kernels with its static
    launcher (env TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1), None in a torch
    without it."""
    import torch._inductor.config as cfg

    name = "static_launch_user_defined_triton_kernels"
    return name if hasattr(cfg, name) else None


def run(report, copy_gbps, quick=False):
    shapes = SHAPES[:1] if quick else SHAPES
    empty, empty_eager = _empty_op()
    for n, v in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        xg = x.detach().requires_grad_(True)
        idx = torch.randint(0, v, (n,), device="cuda", generator=g)
        shape = f"[{n}, {v}] bf16"
        nbytes = x.numel() * x.element_size()
        entries = []  # (group, impl, fn, floor bytes, the impl it is a ratio to), timed together below

        def add(group, impl, fn, floor, base=None):
            entries.append((group, impl, fn, floor, base))

        def fb(f, n_out=1):
            def call():
                out = f(xg)
                outs = out if isinstance(out, tuple) else (out,)
                return torch.autograd.grad(sum(o.sum() for o in outs[:n_out]), xg)[0]
            return call

        T = "torch formula"
        g_ = "selective_log_softmax fwd"
        add(g_, T, lambda: plain_selective(x, idx), nbytes)
        add(g_, "torch_fused", lambda: torch_fused.selective_log_softmax(x, idx), nbytes, T)
        add(g_, "torch.ops.fused (raw op)", lambda: torch.ops.fused.selective_log_softmax(x, idx), nbytes, T)
        add(g_, "empty-kernel op (floor)", lambda: empty(x, idx), 0, T)
        g_ = "entropy_from_logits fwd"
        add(g_, T, lambda: plain_entropy(x), nbytes)
        add(g_, "torch_fused", lambda: torch_fused.entropy_from_logits(x), nbytes, T)
        g_ = "logprobs_and_entropy fwd"
        add(g_, T, lambda: plain_both(x, idx), nbytes)
        add(g_, "torch_fused", lambda: torch_fused.logprobs_and_entropy(x, idx), nbytes, T)
        g_ = "selective_log_softmax fwd+bwd"
        add(g_, T, fb(lambda t: plain_selective(t, idx)), 3 * nbytes)
        add(g_, "torch_fused", fb(lambda t: torch_fused.selective_log_softmax(t, idx)), 3 * nbytes, T)
        add(g_, "empty-kernel op (floor)", fb(lambda t: empty(t, idx)), 0, T)
        add(g_, "empty-kernel autograd.Function (floor)", fb(lambda t: empty_eager(t, idx)), 0, T)
        g_ = "entropy_from_logits fwd+bwd"
        add(g_, T, fb(plain_entropy), 3 * nbytes)
        add(g_, "torch_fused", fb(torch_fused.entropy_from_logits), 3 * nbytes, T)
        g_ = "logprobs_and_entropy fwd+bwd"
        add(g_, T, fb(lambda t: plain_both(t, idx), 2), 3 * nbytes)
        add(g_, "torch_fused", fb(lambda t: torch_fused.logprobs_and_entropy(t, idx), 2), 3 * nbytes, T)
        add(g_, "torch.ops.fused (raw op)", fb(lambda t: torch.ops.fused.logprobs_and_entropy(t, idx), 2),
            3 * nbytes, T)
        # the compiled GRPO-style loss
        torch._dynamo.reset()
        old = torch.randn(n, device="cuda", generator=g) - 5
        adv = torch.randn(n, device="cuda", generator=g)
        mask = (torch.rand(n, device="cuda", generator=g) > 0.2).float()
        ours = torch.compile(grpo_loss(torch_fused.logprobs_and_entropy), fullgraph=True)
        plain = torch.compile(grpo_loss(plain_both), fullgraph=True)
        g_ = "GRPO loss fwd+bwd, compiled"
        base = T + ", compiled"
        for impl, f in ((base, plain), ("torch_fused, compiled", ours)):
            add(g_, impl, lambda f=f: torch.autograd.grad(f(xg, idx, old, adv, mask), xg)[0], 3 * nbytes,
                None if f is plain else base)
        static = _static_user_launch_config()
        if static is not None:
            # Inductor's own static launcher for the log-prob kernels too (off by default in torch:
            # user-defined Triton kernels go through Triton's launcher); the config is read when
            # the graph is compiled, so this function is compiled under it on its first call
            ours_static = torch.compile(grpo_loss(torch_fused.logprobs_and_entropy), fullgraph=True, dynamic=False)
            with torch._inductor.config.patch({static: True}):
                torch.autograd.grad(ours_static(xg, idx, old, adv, mask), xg)
            add(g_, "torch_fused, compiled, static launch of user kernels",
                lambda: torch.autograd.grad(ours_static(xg, idx, old, adv, mask), xg)[0], 3 * nbytes, base)
        # the same step under Inductor's CUDA graphs (mode="reduce-overhead"): a replay per call
        # instead of the launches, so both are timed by their device work. The inputs keep their
        # addresses (mark_static_address: no copy into the graph's input buffers per call).
        xs = x.detach().clone().requires_grad_(True)
        static_in = (xs, idx, old.clone(), adv.clone(), mask.clone())
        for t in static_in:
            torch._dynamo.mark_static_address(t)
        g_ = "GRPO loss fwd+bwd, compiled, CUDA graphs"
        base_cg = T + ", compiled, CUDA graphs"
        for impl, loss in ((base_cg, grpo_loss(plain_both)), ("torch_fused, compiled, CUDA graphs",
                                                              grpo_loss(torch_fused.logprobs_and_entropy))):
            f = torch.compile(loss, fullgraph=True, mode="reduce-overhead")
            add(g_, impl, lambda f=f: torch.autograd.grad(f(*static_in), xs)[0], 3 * nbytes,
                None if impl == base_cg else base_cg)
        # eager forward+backward captured in one CUDA graph (torch.cuda.graph), replayed per call
        g_ = "selective_log_softmax fwd+bwd, CUDA graph"
        add(g_, T + ", CUDA graph", cuda_graph(fb(lambda t: plain_selective(t, idx)))[0], 3 * nbytes)
        add(g_, "torch_fused, CUDA graph", cuda_graph(fb(lambda t: torch_fused.selective_log_softmax(t, idx)))[0],
            3 * nbytes, T + ", CUDA graph")
        # every row of this shape timed in the same rounds: a ratio compares calls timed side by side
        runs = wall_us_runs([e[2] for e in entries])
        by_impl = {(group, impl): r for (group, impl, *_), r in zip(entries, runs)}
        for (group, impl, _, floor, base), r in zip(entries, runs):
            us = median(r)
            note = ""
            if base is not None:
                mid, lo, hi = paired_ratio(r, by_impl[(group, base)])
                note = f"ratio to torch {mid:.2f} ({lo:.2f}-{hi:.2f})"
            report.rows.append(Row(group, shape, impl, us / 1e3, floor, note=note).finish(copy_gbps))
            print(f"{group:36s} {shape:18s} {impl:28s} {us:9.1f} us  {note}", flush=True)
        del x, xg, xs, static_in, idx
        torch.cuda.empty_cache()
    report.extra["calls_per_timing"] = CALLS


def markdown(report) -> str:
    lines = [
        f"Device: {report.device}; torch {report.torch}; triton {report.triton}. Wall time per call, "
        f"{CALLS} calls back to back, warm; the rows of a shape timed in turn, median of {ROUNDS} rounds; "
        f"ratio: ours over torch's formula in the same group and round, the median over the rounds "
        f"(its lowest-highest in brackets).",
        "",
        "| group | shape | impl | us per call | ratio |",
        "|---|---|---|---:|---|",
    ]
    for r in report.rows:
        lines.append(f"| {r.group} | {r.shape} | {r.impl} | {r.ms * 1e3:.1f} | {r.note.replace('ratio to torch ', '')} |")
    return "\n".join(lines) + "\n"


def save(report, out_dir, name) -> None:
    common.save(report, out_dir, name, markdown_fn=markdown)
