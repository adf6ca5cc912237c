"""The eager path's own host cost, on a machine without a GPU: the public log-prob functions'
forward+backward through their Triton implementations with the kernel launches stubbed out
(TRITON_INTERPRET=1 registers them for CPU tensors; ``_library.PlanLaunch`` is patched to launch
nothing), beside ``autograd.Function`` nodes that do nothing but what any such node must (the same
inputs, saved tensors and allocations, no plan, no check). The difference is the Python of our
path above autograd's own cost: plan lookups, wrappers, the formula. The output values are not
computed (stubbed launches), only the calls are timed.

    python tools/eager_overhead.py [--shape 64,1024] [--calls 2000] [--rounds 15]

Prints microseconds per call, the minimum over the rounds (a CPU host's timing noise is upward),
rows timed in turn within each round. On a host busy with other work the figures swing by tens of
us: run it on an idle host, with the default 15 rounds or more. For the GPU picture (launches,
the autograd device thread) see tools/host_profile.py."""
import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before torch_fused is imported: its Triton impls then serve CPU tensors

import torch  # noqa: E402

import torch_fused  # noqa: E402
from torch_fused import _library  # noqa: E402
from torch_fused.meta.logprobs import LogprobOptions  # noqa: E402


class _Bare(torch.autograd.Function):
    """One input, one saved tensor, one output and its gradient allocated: autograd's floor."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.new_empty(x.shape[:-1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.empty_like(x)


class _Shaped(torch.autograd.Function):
    """What our node holds, doing nothing else: four inputs (logits, index, tensor temperature,
    options), the log-probs and the row statistics allocated, the logits, index and statistics
    saved with two None slots, the options, and d logits allocated in the backward."""

    @staticmethod
    def forward(ctx, x, index, temperature_t, opts):
        out = x.new_empty(x.shape[:-1], dtype=torch.float32)
        stats = x.new_empty(x.shape[:-1] + (2,), dtype=torch.float32)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, index, stats, None, None)
        ctx.opts = opts
        return out

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        return torch.empty_like(saved[0]), None, None, None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="64,1024", help="rows,V of the bf16 logits (default 64,1024)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    rows, v = (int(s) for s in args.shape.split(","))
    if "cpu" not in _library.TRITON_DEVICES:  # torch_fused imported before TRITON_INTERPRET was set
        raise SystemExit("eager_overhead: the Triton implementations do not serve CPU tensors in this process "
                         "(TRITON_INTERPRET=1 must be set before torch_fused is imported); run it as a script")
    real_launch = _library.PlanLaunch.__call__
    _library.PlanLaunch.__call__ = lambda self, grid, *a: None  # no kernel runs (restored below)
    try:
        _measure(args, rows, v)
    finally:
        _library.PlanLaunch.__call__ = real_launch


_OPTS = LogprobOptions(1.0, -100, False, False)


def _measure(args, rows, v):
    torch.manual_seed(0)
    x = torch.randn(rows, v, dtype=torch.bfloat16).requires_grad_(True)
    idx = torch.randint(0, v, (rows,))

    def fb(f):
        # autograd.grad, not .backward(): no accumulation into x.grad in the timed loop
        def step():
            y = f()
            torch.autograd.grad((y if isinstance(y, torch.Tensor) else y[0] + y[1]).sum(), x)
        return step

    cases = [
        ("autograd.Function floor (1 input, 1 saved)", fb(lambda: _Bare.apply(x))),
        ("autograd.Function shaped like our node", fb(lambda: _Shaped.apply(x, idx, None, _OPTS))),
        ("selective_log_softmax", fb(lambda: torch_fused.selective_log_softmax(x, idx))),
        ("entropy_from_logits", fb(lambda: torch_fused.entropy_from_logits(x))),
        ("logprobs_and_entropy", fb(lambda: torch_fused.logprobs_and_entropy(x, idx))),
    ]
    times = [[] for _ in cases]
    for _, f in cases:  # warm: plans made, caches filled
        for _ in range(50):
            f()
    for _ in range(args.rounds):
        for i, (_, f) in enumerate(cases):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            times[i].append((time.perf_counter() - t0) / args.calls * 1e6)
    best = [min(t) for t in times]
    if best[1] < best[0]:
        print("warning: the shaped node timed below the floor: the host was too noisy for this run "
              "(more --rounds, or an idle host)")
    print(f"torch {torch.__version__}, bf16 [{rows}, {v}], fwd + .sum() + autograd.grad, launches stubbed; "
          f"us per call, min of {args.rounds} rounds of {args.calls} calls")
    for (name, _), b in zip(cases, best):
        # the shaped node is selective_log_softmax's (the others save or return more)
        extra = f"   (+{b - best[1]:.1f} over the shaped node)" if name == "selective_log_softmax" else ""
        print(f"  {name:45s} {b:7.1f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
