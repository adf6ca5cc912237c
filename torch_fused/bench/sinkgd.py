"""Benchmarks of one optimizer step: SinkGD (fused::sinkgd_step) vs torch.optim.AdamW(fused=True)
and a torch.compile'd per-parameter loop of the SinkGD formula, bf16 params and grads.

Floor: read G, read W, write W (3 x the bf16 parameter bytes) over the same-run copy bandwidth;
a SinkGD step with L iterations moves L + 3 gradient-sized passes in this implementation (one
read of G per iteration, then the update), plus the small column partials; the spectral step
adds one read of G per power iteration.

Each SinkGD configuration is reported as a ratio to fused AdamW on the same parameters, with
PASS / FAIL against the bars in BARS (the note column and the printed line).
"""

from __future__ import annotations

import math

import torch

from ..optim import SinkGD
from ..settings import current as settings
from .common import Row, bench_ms, peak_extra_mb

LLAMA_LAYER = [(4096, 4096), (4096, 4096), (1024, 4096), (1024, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
GPT2_SMALL = [(50257, 768), (1024, 768)] + [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12


def _params(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
        p.grad = torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
        ps.append(p)
    return ps


def formula_step(ws, gs, lr: float, iters: int, lr_scale=0.05, eps=1e-8):
    """The SinkGD formula, per parameter, in fp32 (what a user would torch.compile)."""
    for w, g in zip(ws, gs):
        m, n = w.shape[-2:]
        x = g.float()
        for _ in range(iters):
            x = math.sqrt(n) * x / x.norm(dim=-1, keepdim=True).clamp_min(eps)
            x = math.sqrt(m) * x / x.norm(dim=-2, keepdim=True).clamp_min(eps)
        w.copy_((w.float() - lr * lr_scale * x).to(w.dtype))


# (label, SinkGD settings, the bar: at most this many times fused AdamW's time, or None)
CONFIGS = [
    ("SinkGD L=5", dict(sinkhorn_iters=5), 1.0),
    ("SinkGD L=1", dict(sinkhorn_iters=1), None),
    ("SinkGD L=5 spectral", dict(sinkhorn_iters=5, spectral_norm=True, spectral_target="muon", spectral_iters=1), 1.3),
    ("SinkGD L=1 spectral", dict(sinkhorn_iters=1, spectral_norm=True, spectral_target="muon", spectral_iters=1), 0.8),
]


def _state_mib(opt) -> float:
    """MiB of the tensors an optimizer keeps in its state between steps."""
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor)) / 2**20


def run(report, copy_gbps, quick=False):
    cases = [("Llama-3-8B x1 layer", LLAMA_LAYER), ("GPT-2 small 2-D weights", GPT2_SMALL)]
    if not quick:
        cases.insert(1, ("Llama-3-8B x4 layers", LLAMA_LAYER * 4))
    verdicts = []
    for name, shapes in cases:
        params = _params(shapes)
        nbytes = sum(p.numel() for p in params) * 2
        floor = 3 * nbytes
        adam = torch.optim.AdamW(params, lr=1e-4, fused=True)
        adam.step()  # initialize the state outside the timing
        adam_ms = bench_ms(adam.step)
        # the memory column: a step's peak above its inputs plus the state the optimizer holds
        # between steps (AdamW's moments; SinkGD's graph buffers and warm-start vectors)
        rows = [("torch AdamW fused", adam_ms, peak_extra_mb(adam.step) + _state_mib(adam), None)]
        del adam  # its moments are not needed past this point
        torch.cuda.empty_cache()
        for label, kw, bar in CONFIGS:
            opt = SinkGD(params, lr=torch.tensor(1e-3, device="cuda"), **kw)
            opt.step()
            ms = bench_ms(opt.step)
            # per-step peak, plus what the step's CUDA graph holds between steps (its buffers)
            held = opt.plan_cache.graph_held_bytes() / 2**20
            rows.append((label, ms, peak_extra_mb(opt.step) + held + _state_mib(opt), bar))
            opt.plan_cache.clear()  # frees this configuration's graphs before the next one
            del opt
        # compile time of the unrolled loop grows with the param count; TORCH_FUSED_BENCH_SINKGD_COMPILE=0 skips it
        if name == "Llama-3-8B x1 layer" and settings.bench_sinkgd_compile:
            ws = [p.data for p in params]
            gs = [p.grad for p in params]
            torch._dynamo.reset()
            comp = torch.compile(formula_step)
            comp(ws, gs, 1e-3, 5)
            ms = bench_ms(lambda: comp(ws, gs, 1e-3, 5))
            rows.append(("torch.compile loop L=5", ms, peak_extra_mb(lambda: comp(ws, gs, 1e-3, 5)), None))
        for impl, ms, pk, bar in rows:
            note = ""
            if impl != "torch AdamW fused":
                ratio = ms / adam_ms
                note = f"{ratio:.2f}x AdamW fused"
                if bar is not None:
                    verdict = "PASS" if ratio <= bar else "FAIL"
                    note += f" ({verdict}: bar {bar:.1f}x)"
                    verdicts.append((name, impl, ratio, bar, verdict))
            report.rows.append(Row("optimizer step", f"{name} ({len(shapes)} mats, {nbytes / 2**30:.2f} GiB bf16)",
                                   impl, ms, floor, peak_extra_mb=pk, note=note).finish(copy_gbps))
            r = report.rows[-1]
            print(f"sinkgd {name:26s} {impl:24s} {ms:8.3f} ms  {r.frac_floor:.3f} of floor  {note}  peak {pk:.0f} MiB",
                  flush=True)
        del params
        torch.cuda.empty_cache()
    report.extra["sinkgd_bars"] = [dict(params=n, impl=i, ratio=round(x, 3), bar=b, verdict=v)
                                   for n, i, x, b, v in verdicts]
    failed = [v for v in verdicts if v[-1] == "FAIL"]
    print(f"sinkgd bars: {len(verdicts) - len(failed)} PASS, {len(failed)} FAIL"
          + "".join(f"\n  FAIL {n}: {i} {x:.2f}x > {b:.1f}x" for n, i, x, b, _ in failed), flush=True)
