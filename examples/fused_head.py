"""The fused lm_head against materialized logits: the same values and gradients, without the logits.

    python examples/fused_head.py                                   # CPU or CUDA, small sizes
    python examples/fused_head.py --device cuda --tokens 16384 --hidden 4096 --vocab 151936 --dtype bfloat16

Both sides compute, from the last hidden states [B, L+1, H] and lm_head.weight [V, H], the
log-prob of each next token (position t scores tokens[:, t], shift=True) and the entropy of
each position's distribution, then backpropagate one loss through them:

    materialized: logits = hidden @ weight.T                       [B, L+1, V] in memory
                  torch_fused.logprobs_and_entropy(logits, tokens, shift=True)
    fused:        torch_fused.linear_logprobs_and_entropy(hidden, weight, tokens, shift=True)

The script checks that log-probs, entropies, d hidden and d weight agree (relative error norms
within a tolerance per dtype) and raises otherwise. Memory: on CUDA it prints the peak memory of
each side above its inputs (the fused head holds chunk buffers and an fp32 d hidden accumulator,
the materialized side the [B, L+1, V] logits and their gradient); on CPU it prints the size of
the logits the fused head never holds.

Speed: on CUDA the fused head runs Triton kernels. On CPU it runs its plain-PyTorch reference
implementation (the specification of those kernels, chunk by chunk), which is not faster than
materialized logits: there the example shows agreement and memory, and the times it prints are
no measure of the fused head's speed (docs/BENCHMARKS.md has the GPU figures).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import torch_fused

# relative error norm allowed between the two sides: the fused head computes its logits as fp32
# GEMM results, the materialized side rounds them to the input dtype first
TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(TOL))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="L, scored tokens per sequence")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=5000)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("batch", "tokens", "hidden", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if not args.temperature > 0:
        p.error(f"--temperature: expected > 0, got {args.temperature}")
    return args


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """The relative error norm of got against ref; raises AssertionError naming the tensor above tol."""
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shapes differ, fused {tuple(got.shape)} vs materialized {tuple(ref.shape)}")
    err = rel_err(got, ref)
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"{name}: fused and materialized differ, relative error {err:.3e} > {tol:.1e}")
    return err


def _run(fn, device):
    """(outputs, ms, peak MiB above the memory before the call or None on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
    return out, ms, peak


def main(argv=None):
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(args.seed)
    b, l, h, v = args.batch, args.tokens, args.hidden, args.vocab
    hidden0 = torch.randn(b, l + 1, h, device=device, generator=g).to(dtype)
    weight0 = (torch.randn(v, h, device=device, generator=g) * 2 / h**0.5).to(dtype)
    tokens = torch.randint(0, v, (b, l), device=device, generator=g)
    coef, temp = args.entropy_coef, args.temperature

    def side(fused: bool):
        hidden = hidden0.clone().requires_grad_(True)
        weight = weight0.clone().requires_grad_(True)

        def step():
            if fused:
                logp, ent = torch_fused.linear_logprobs_and_entropy(hidden, weight, tokens, shift=True,
                                                                    temperature=temp)
            else:
                logits = hidden @ weight.t()  # [B, L+1, V]
                logp, ent = torch_fused.logprobs_and_entropy(logits, tokens, shift=True, temperature=temp)
            (-logp.mean() - coef * ent.mean()).backward()
            return logp.detach(), ent.detach()

        (logp, ent), ms, peak = _run(step, device)
        return dict(logp=logp, ent=ent, d_hidden=hidden.grad, d_weight=weight.grad, ms=ms, peak=peak)

    # first calls (kernel compilation, the allocator, on the CPU too) outside the figures
    side(True), side(False)
    fused, mat = side(True), side(False)
    tol = TOL[args.dtype]
    errs = {name: check_close(name, fused[name], mat[name], tol) for name in ("logp", "ent", "d_hidden", "d_weight")}
    print(f"B{b} L{l} H{h} V{v} {args.dtype} on {device}: fused vs materialized relative errors "
          + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()) + f" (tolerance {tol:.0e})")
    logits_mib = b * (l + 1) * v * hidden0.element_size() / 2**20
    if device.type == "cuda":
        print(f"peak memory above the inputs: fused {fused['peak']:.1f} MiB, materialized {mat['peak']:.1f} MiB "
              f"(the logits alone: {logits_mib:.1f} MiB); forward+backward time: fused {fused['ms']:.2f} ms, "
              f"materialized {mat['ms']:.2f} ms")
    else:
        print(f"the materialized side holds the {logits_mib:.1f} MiB logits and their gradient; the fused head "
              f"never does; forward+backward time: fused {fused['ms']:.1f} ms, materialized {mat['ms']:.1f} ms")
        if os.environ.get("TRITON_INTERPRET") == "1":
            print(f"on {device.type} under TRITON_INTERPRET=1 the fused head runs the Triton kernels through Triton's "
                  "interpreter, a correctness check far slower than the compiled kernels: these times are no measure "
                  "of its speed")
        else:
            print(f"on {device.type} the fused head runs its plain-PyTorch reference implementation, not the Triton "
                  "kernels: it is not faster than materialized logits here, and these times are no measure of its "
                  "speed on CUDA")
    return errs


if __name__ == "__main__":
    main()
