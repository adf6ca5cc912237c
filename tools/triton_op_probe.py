"""Would ``torch.library.triton_op`` make the compiled log-prob path cheaper? A probe, not a
shipped path: the log-prob forward and backward kernels registered a second time, as triton_ops
(``wrap_triton`` launches, so Inductor calls the kernels from its own generated code instead of
running a custom op's Python implementation per call), with the same autograd formula. It times
the small suite's GRPO-style loss fwd+bwd under ``torch.compile(fullgraph=True)`` with the
shipped ops, with the triton_op pair and with torch's plain formula, and checks that the three
agree. Writes $OUT/triton_op_probe.txt (and prints it).

CUDA: ``python tools/triton_op_probe.py`` (Inductor). On a CPU, ``TRITON_INTERPRET=1 python
tools/triton_op_probe.py --check`` runs the three losses uncompiled at one small shape and checks
values only (the interpreter cannot be traced: it runs a kernel on fake tensors)."""
import os
import sys
import types

import torch
import torch._functorch.config
import torch._inductor.config
from torch.library import triton_op, wrap_triton

import torch_fused
from torch_fused._library import new_output
from torch_fused.settings import override
from torch_fused.bench.small import ROUNDS, grpo_loss, plain_both, wall_us_rounds
from torch_fused.ops import logprobs as L

NS = "torch_fused_probe"


# A traced launch gives each pointer argument its own tensor and None to the ones it does not
# touch: the functional graph copies each argument the kernel may write, and the copy of the last
# argument naming a tensor replaces it (_library.launch).
@triton_op(f"{NS}::fwd", mutates_args=())
def probe_fwd(logits: torch.Tensor, index: torch.Tensor, temperature: float, ignore_index: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = L._forward_plan(logits, index, temperature, ignore_index, True, None, False)
    (s_logp, s_ent, s_stats), dt, rows, copy, (inner, s_outer, s_inner), index_copy, k, v, c, constexprs, K = plan
    logp = new_output(s_logp, dt, logits.device)
    ent = new_output(s_ent, dt, logits.device)
    stats = new_output(s_stats, dt, logits.device)
    x = logits.contiguous() if copy else logits
    idx = index.contiguous() if index_copy else index
    wrap_triton(K._logprobs_entropy_forward_kernel)[(rows,)](
        x, idx, logp, ent, stats, None, v, k, inner, s_outer, s_inner, c, ignore_index, **constexprs)
    return logp, ent, stats


@triton_op(f"{NS}::bwd", mutates_args=())
def probe_bwd(g_logp: torch.Tensor, g_ent: torch.Tensor, logits: torch.Tensor, index: torch.Tensor,
              stats: torch.Tensor, ent: torch.Tensor, temperature: float, ignore_index: int) -> torch.Tensor:
    plan = L._backward_plan(g_logp, g_ent, logits, index, temperature, ignore_index, None, False, 0, None, None,
                            None, False, None)
    dx_dtype, rows, k, (x_copy, idx_copy, glp_copy, gh_copy), scalars, constexprs, grid, K = plan
    dx = new_output(logits.shape, dx_dtype, logits.device)
    x = logits.contiguous() if x_copy else logits
    idx = index.contiguous() if idx_copy else index
    glp = g_logp.reshape(rows, k) if glp_copy else g_logp
    gh = g_ent.reshape(rows) if gh_copy else g_ent
    wrap_triton(K._logprobs_entropy_backward_kernel)[(grid,)](
        x, idx, glp, gh, stats, ent, dx, None, None, None, *scalars, **constexprs)
    return dx


def _setup(ctx, inputs, output):
    logits, index, temperature, ignore_index = inputs
    _, ent, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.save_for_backward(logits, index, stats, ent)


def _backward(ctx, g_logp, g_ent, _g_stats):
    logits, index, stats, ent = ctx.saved_tensors
    if g_logp is None:
        g_logp = torch.zeros_like(ent)
    if g_ent is None:
        g_ent = torch.zeros_like(ent)
    return probe_bwd(g_logp, g_ent, logits, index, stats, ent, ctx.temperature, ctx.ignore_index), None, None, None


probe_fwd.register_autograd(_backward, setup_context=_setup)


def _own_code(fn, tag):
    """fn with a code object of its own, so that torch.compile keeps a compiled graph for it apart
    from those of other copies of the same function."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def probe_both(logits, index):
    logp, ent, _ = probe_fwd(logits, index, 1.0, -100)
    return logp, ent


def main():
    check_only = "--check" in sys.argv
    device = "cuda" if torch.cuda.is_available() and not check_only else "cpu"
    backend = "inductor" if device == "cuda" else "none (uncompiled)"
    shapes = [(64, 1024), (512, 4096), (512, 32000), (4096, 32000)] if device == "cuda" else [(6, 40)]
    lines = [f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
             f"backend {backend}; GRPO-style loss fwd+bwd, bf16 logits, wall us per call (200 calls, median of {ROUNDS} rounds, the variants timed in turn within a round)",
             "", "| shape | plain formula, compiled | torch_fused ops, compiled (launches inlined) | "
             "torch_fused ops, compiled (opaque op calls) | triton_op pair, compiled | "
             "max abs diff of d logits from the plain formula's, and non-finite counts |", "|---|---:|---:|---:|---:|---:|"]
    # no compiled graph from torch.compile's caches: their key is what Dynamo traced, the same for
    # the ops and opaque variants; the settings tag them apart where torch has cache_key_tag
    # (settings.py), and this covers torch without it
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    for n, v in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        x = torch.randn(n, v, device=device, generator=g).to(dt).requires_grad_(True)
        ids = torch.randint(0, v, (n,), device=device, generator=g)
        old = torch.randn(n, device=device, generator=g) * 0.1 - 5
        adv = torch.randn(n, device=device, generator=g)
        mask = (torch.rand(n, device=device, generator=g) > 0.2).float()
        variants = (("plain", plain_both), ("ops", torch_fused.logprobs_and_entropy),
                    ("opaque", torch_fused.logprobs_and_entropy), ("probe", probe_both))
        grads, fns = {}, {}
        torch._dynamo.reset()
        for name, f in variants:
            # each variant compiled with static shapes into its own code object (its own compiled
            # code: the ops and opaque variants are one function, traced in different settings),
            # and all of them timed in the same rounds
            loss = _own_code(grpo_loss(f), name)
            fn = torch.compile(loss, fullgraph=True, dynamic=False) if device == "cuda" else loss
            with override(compile_inline_kernels=name != "opaque"):
                grads[name] = torch.autograd.grad(fn(x, ids, old, adv, mask), x)[0].float()
            fns[name] = lambda fn=fn: torch.autograd.grad(fn(x, ids, old, adv, mask), x)
        if not check_only:
            us = dict(zip(fns, wall_us_rounds(list(fns.values()))))
        bad = {name: int((~torch.isfinite(gr)).sum()) for name, gr in grads.items()}
        diffs = {name: (grads[name] - grads["plain"]).abs().max().item() for name in ("ops", "opaque", "probe")}
        detail = "; ".join(f"{k} {v:.3g}" for k, v in diffs.items()) + \
            "".join(f"; {k}: {v} non-finite" for k, v in bad.items() if v)
        if check_only:
            lines.append(f"| [{n}, {v}] | | | | | {detail} |")
            continue
        lines.append(f"| [{n}, {v}] | {us['plain']:.1f} | {us['ops']:.1f} | {us['opaque']:.1f} | {us['probe']:.1f} | "
                     f"{detail} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not check_only:
        with open(os.path.join(os.environ.get("OUT", "."), "triton_op_probe.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
