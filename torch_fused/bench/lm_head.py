"""The fused lm_head, ``linear_logprobs_and_entropy``, against the bare GEMMs of the same run.

Floor: forward, one GEMM (hidden @ weight.T); forward+backward, the three GEMMs of a
materialized head (logits, d hidden = d logits @ weight, d weight = d logits.T @ hidden),
bf16 with fp32 accumulation, timed alone. Peak extra memory: above the inputs, not counting the
returned gradients. Baseline in the same run: the materialized logits with the fused log-prob
op (shift-free rows). ``python -m torch_fused.bench.lm_head --cpu-memory`` measures the peak RSS
growth of a CPU forward+backward in a fresh process instead.
"""

from __future__ import annotations

import torch

import torch_fused

from .common import Row, bench_ms, peak_extra_mb, warm_up

SHAPES = [(8192, 4096, 151936), (16384, 3584, 151936), (32768, 4096, 32000)]  # (N, H, V)


def run(report, copy_gbps, quick=False):
    for n, hd, v in SHAPES[:1] if quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(n, hd, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(v, hd, device="cuda", generator=g) / hd**0.5 * 2).to(torch.bfloat16).requires_grad_(True)
        idx = torch.randint(0, v, (n,), device="cuda", generator=g)
        shape = f"N{n} H{hd} V{v}"
        hb, wb = h.detach(), w.detach()
        dl = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
        gemm1 = bench_ms(lambda: hb @ wb.t())
        gemm3 = bench_ms(lambda: (hb @ wb.t(), dl @ wb, dl.t() @ hb))
        del dl
        torch.cuda.empty_cache()
        report.extra.setdefault("gemm_ms", {})[shape] = {"fwd": gemm1, "fwd+bwd": gemm3}
        logits_mib = n * v * 2 / 2**20
        grads_bytes = h.numel() * 2 + w.numel() * 2

        def fused_fwd():
            return torch_fused.linear_logprobs_and_entropy(hb, wb, idx)

        def fused_fwdbwd():
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
            return torch.autograd.grad(lp.sum() + ent.sum(), (h, w))

        def materialized_fwdbwd():
            logits = h @ w.t()
            lp, ent = torch_fused.logprobs_and_entropy(logits, idx)
            return torch.autograd.grad(lp.sum() + ent.sum(), (h, w))

        warm_up(fused_fwd)
        for group, impl, fn, floor_ms, grads in [
                ("lm_head fwd", "torch_fused linear_logprobs_and_entropy", fused_fwd, gemm1, 0),
                ("lm_head fwd+bwd", "torch_fused linear_logprobs_and_entropy", fused_fwdbwd, gemm3, grads_bytes),
                ("lm_head fwd+bwd", "materialized logits + torch_fused op", materialized_fwdbwd, gemm3, grads_bytes)]:
            ms = bench_ms(fn, warmup=5, rep=200)
            pk = peak_extra_mb(fn, grads)
            row = Row(group, shape, impl, ms, 0, peak_extra_mb=pk,
                      note=f"{ms / floor_ms:.3f}x the bare GEMMs ({floor_ms:.3f} ms); logits {logits_mib:.0f} MiB")
            row.floor_ms = floor_ms
            row.frac_floor = floor_ms / ms
            report.rows.append(row)
            print(f"{group:16s} {shape:22s} {impl:40s} {ms:8.3f} ms  {ms / floor_ms:.3f}x GEMMs  "
                  f"peak extra {pk:.0f} MiB (logits {logits_mib:.0f} MiB)", flush=True)
        del h, w, hb, wb, idx
        torch.cuda.empty_cache()


def cpu_peak_rss_growth_mib(n=4096, hd=64, v=32768) -> float:
    """Peak RSS growth (MiB) of one fp32 forward+backward on CPU, measured in this process: run
    it in a fresh process with MALLOC_MMAP_THRESHOLD_=65536 so freed large blocks leave the RSS."""
    import resource

    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hd, generator=g, requires_grad=True)
    w = torch.randn(v, hd, generator=g, requires_grad=True)
    idx = torch.randint(0, v, (n,), generator=g)
    torch_fused.linear_logprobs_and_entropy(h[:2], w[:8], idx[:2] % 8)  # imports and first-call setup
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
    torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (after - before) / 1024


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench.lm_head")
    ap.add_argument("--cpu-memory", action="store_true",
                    help="peak RSS growth of a CPU fp32 forward+backward at N=4096, H=64, V=32768 (512 MiB of "
                         "logits); run with MALLOC_MMAP_THRESHOLD_=65536")
    args = ap.parse_args()
    if args.cpu_memory:
        print(f"peak RSS growth: {cpu_peak_rss_growth_mib():.1f} MiB (logits would be 512 MiB)")
