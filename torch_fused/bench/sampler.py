"""Log-probs over the sampler's support (bf16 logits): forward+backward of selective_log_softmax
with top_k, top_p and min_p against the unrestricted op and against what users write by hand
(vLLM's rule in torch: sort, cumulative sum, mask, log_softmax), same run.

Floor: read, read, write of the logits' size (as the logprobs suite's fwd+bwd). Each row's note
gives its time over the unrestricted op's fwd+bwd at the same shape (the bars: top-k up to 256
and min-p at most 1.3x, top-p at most 2.0x) and its peak memory beside the unrestricted op's.
"""

from __future__ import annotations

import torch

import torch_fused

from .common import Row, bench_ms, peak_extra_mb, warm_up

SHAPES = [(1, 1024, 151936), (1, 4096, 151936), (1, 16384, 32000)]
FULL = "torch_fused, full vocabulary"


def _bar(impl: str) -> float | None:
    """The time bar of a torch_fused row, over the full vocabulary's: top-p 2.0x, top-k (k <= 256)
    and min-p 1.3x."""
    if not impl.startswith("torch_fused") or impl == FULL:
        return None
    return 2.0 if "top_p" in impl else 1.3


def handwritten(logits, index, top_k=None, top_p=None):
    """The usual torch version: float32 logits, top-k by k-th value, top-p by ascending sort and
    cumulative sum, then log_softmax and a gather."""
    z = logits.float()
    if top_k is not None:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None:
        srt, order = z.sort(-1)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(z, -1).gather(-1, index[..., None])[..., 0]


def run(report, copy_gbps, quick=False):
    for b, l, v in SHAPES[:1] if quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(b, l, v, device="cuda", dtype=torch.bfloat16, generator=g) * 3).requires_grad_(True)
        idx = torch.randint(0, v, (b, l), device="cuda", generator=g)
        shape = f"N{b * l} V{v}"
        nbytes = x.numel() * x.element_size()
        cases = {
            FULL: lambda: torch_fused.selective_log_softmax(x, idx),
            "torch_fused top_k=50": lambda: torch_fused.selective_log_softmax(x, idx, top_k=50),
            "torch_fused top_k=256": lambda: torch_fused.selective_log_softmax(x, idx, top_k=256),
            "torch_fused min_p=0.05": lambda: torch_fused.selective_log_softmax(x, idx, min_p=0.05),
            "torch_fused top_p=0.9": lambda: torch_fused.selective_log_softmax(x, idx, top_p=0.9),
            "torch_fused top_k=50 top_p=0.9": lambda: torch_fused.selective_log_softmax(x, idx, top_k=50, top_p=0.9),
            "torch_fused min_p=0.05 top_p=0.9": lambda: torch_fused.selective_log_softmax(x, idx, min_p=0.05,
                                                                                          top_p=0.9),
            "handwritten top_k=50": lambda: handwritten(x, idx, top_k=50),
            "handwritten top_p=0.9": lambda: handwritten(x, idx, top_p=0.9),
        }
        base = None  # the unrestricted op's (ms, peak MiB) at this shape
        for impl, f in cases.items():
            def fn(f=f):
                lp = f()
                return torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum(), x)

            try:
                warm_up(fn)
                ms = bench_ms(fn)
                pk = peak_extra_mb(fn)
            except torch.OutOfMemoryError:
                print(f"{shape:16s} {impl:32s} out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            if impl == FULL:
                base = (ms, pk)
            note = ""
            if base is not None:
                bar = _bar(impl)
                note = (f"{ms / base[0]:.2f}x the full vocabulary's fwd+bwd" + (f" (bar {bar}x)" if bar else "")
                        + f"; {pk - base[1]:+.0f} MiB beside its peak")
            row = Row("selective_log_softmax fwd+bwd", shape, impl, ms, 3 * nbytes, peak_extra_mb=pk,
                      note=note).finish(copy_gbps)
            report.rows.append(row)
            print(f"{shape:16s} {impl:34s} {ms:8.3f} ms  {row.frac_floor:.3f} of floor  {pk:8.0f} MiB  {note}", flush=True)
        del x
        torch.cuda.empty_cache()
