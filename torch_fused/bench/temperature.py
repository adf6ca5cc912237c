"""The log-prob backward with a tensor temperature (bf16 logits): forward+backward of
selective_log_softmax with a float temperature, a 0-dim tensor temperature that requires no
grad, and one that does (d T computed).

A tensor temperature that requires no grad computes no d T partials, so its backward splits
long rows into segments as a float temperature's does; d T needs one program per row (its row
partials). Floor: read, read, write of the logits' size (as the logprobs suite's fwd+bwd).
"""

from __future__ import annotations

import torch

import torch_fused

from .common import Row, bench_ms, peak_extra_mb, warm_up

SHAPES = [(8, 1024, 151936), (4, 4096, 151936), (16, 4096, 32000)]


def run(report, copy_gbps, quick=False):
    for b, l, v in SHAPES[:1] if quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(b, l, v, device="cuda", dtype=torch.bfloat16, generator=g) * 3).requires_grad_(True)
        idx = torch.randint(0, v, (b, l), device="cuda", generator=g)
        shape = f"B{b} L{l} V{v}"
        nbytes = x.numel() * x.element_size()
        temps = {
            "float temperature": (0.7, False),
            "tensor temperature, no grad": (torch.tensor(0.7, device="cuda"), False),
            "tensor temperature, d T": (torch.tensor(0.7, device="cuda", requires_grad=True), True),
        }
        for impl, (t, want_dt) in temps.items():
            inputs = (x, t) if want_dt else (x,)

            def fn(t=t, inputs=inputs):
                return torch.autograd.grad(torch_fused.selective_log_softmax(x, idx, temperature=t).sum(), inputs)

            warm_up(fn)
            ms = bench_ms(fn)
            row = Row("selective_log_softmax fwd+bwd", shape, impl, ms, 3 * nbytes,
                      peak_extra_mb=peak_extra_mb(fn)).finish(copy_gbps)
            report.rows.append(row)
            print(f"{shape:24s} {impl:30s} {ms:8.3f} ms  {row.frac_floor:.3f} of floor", flush=True)
        del x
        torch.cuda.empty_cache()
