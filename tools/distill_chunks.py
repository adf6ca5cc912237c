"""The distillation head's chunk and group sizes (CUDA): ``linear_distill`` forward+backward, the
reduced mode (``token-mean``) and the per-token mode, under several ``distill_chunk_bytes`` /
``distill_group_bytes`` / ``distill_max_extra`` settings, as a multiple of the four bare GEMMs
(teacher forward, student forward, d hidden, d weight) timed around each row, with peak extra
memory; TRL's ``ChunkedDivergenceFunction`` beside them where trl is installed.

    python tools/distill_chunks.py [N V Hs Ht] [--profile]

(default 8192 151936 2048 4096, bf16, beta 0.5). ``--profile`` adds a kernel-time table of one
call of each mode at the default settings.
"""

from __future__ import annotations

import argparse

import torch

import torch_fused
from torch_fused.bench.common import bench_ms, peak_extra_mb, timed_against_floor, warm_up
from torch_fused.settings import override

MB = 1 << 20


def configs(v):
    """{label: settings}: the default, then token-row chunks and d logits groups of given rows."""
    def rows(chunk, group, frac=None):
        return dict(distill_max_extra={} if frac is None else {"cuda": frac},
                    distill_chunk_bytes={"cuda": chunk * 8 * v, "cpu": 4 * MB},
                    distill_group_bytes={"cuda": group * 2 * v, "cpu": 4 * MB})

    return {"default": {}, "rows 208 group 832": rows(208, 832), "rows 256 group 1024": rows(256, 1024),
            "rows 128 group 1536": rows(128, 1536), "rows 1024 group 4096": rows(1024, 4096)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 151936, 2048, 4096])
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/distill_chunks.py times CUDA kernels: no CUDA device here")
    n, v, hs_, ht_ = a.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    hs = torch.randn(n, hs_, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    ws = (torch.randn(v, hs_, device="cuda", generator=g) * 2 / hs_**0.5).to(torch.bfloat16).requires_grad_()
    ht = torch.randn(n, ht_, device="cuda", generator=g).to(torch.bfloat16)
    wt = (torch.randn(v, ht_, device="cuda", generator=g) * 2.5 / ht_**0.5).to(torch.bfloat16)
    hb, wb = hs.detach(), ws.detach()
    dl = torch.randn(n, v, device="cuda", generator=g).to(torch.bfloat16)
    floor = lambda: (ht @ wt.t(), hb @ wb.t(), dl @ wb, dl.t() @ hb)  # noqa: E731
    warm_up(floor)
    grads = hs.numel() * 2 + ws.numel() * 2

    def reduced():
        return torch.autograd.grad(torch_fused.linear_distill(hs, ws, ht, wt, beta=0.5, reduction="token-mean"),
                                   (hs, ws))

    def per_token():
        return torch.autograd.grad(torch_fused.linear_distill(hs, ws, ht, wt, beta=0.5).mean(), (hs, ws))

    def row(label, mode, f):
        warm_up(f, ms=50.0)
        ms, fl = timed_against_floor(lambda: bench_ms(f, warmup=2, rep=20), lambda: bench_ms(floor))
        print(f"N{n} V{v} {label:24s} {mode:9s} {ms:8.2f} ms {ms / fl:6.3f}x GEMMs ({fl:.2f} ms) "
              f"peak extra {peak_extra_mb(f, grads):7.0f} MiB", flush=True)

    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        def trl():
            div, _ = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, 0.5, 1.0)
            return torch.autograd.grad(div.mean(), (hs, ws))

        row("TRL ChunkedDivergence", "per-token", trl)
    except ImportError as e:
        print(f"TRL not run: {e}")
    torch.cuda.empty_cache()
    for label, kw in configs(v).items():
        for mode, f in (("reduced", reduced), ("per-token", per_token)):
            with override(**kw):
                row(label, mode, f)
            torch.cuda.empty_cache()
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for mode, f in (("reduced", reduced), ("per-token", per_token)):
            f()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                f()
                torch.cuda.synchronize()
            print(f"== profile {mode}")
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main()
