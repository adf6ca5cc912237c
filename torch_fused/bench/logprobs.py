"""Benchmarks of selective_log_softmax, entropy_from_logits and logprobs_and_entropy (bf16).

Floors: forward = one read of the logits (outputs are O(rows)); forward+backward = read,
read, write of the logits' size. Baselines, all in the same run: torch eager, torch.compile of
the plain formula, TRL's looped / chunked versions (their algorithm, written here), and the
two separate fused calls in place of logprobs_and_entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_fused
from torch_fused.settings import override

from .common import Row, bench_ms, peak_extra_mb, warm_up

SHAPES = [(8, 1024, 151936), (4, 4096, 151936), (16, 4096, 32000)]


# --- baselines (the formulas users run today) -------------------------------------------------
def plain_selective(logits, index):
    return torch.log_softmax(logits.float(), -1).gather(-1, index[..., None]).squeeze(-1)


def plain_entropy(logits):
    lp = torch.log_softmax(logits.float(), -1)
    return -(lp.exp() * lp).sum(-1)


def trl_looped_selective(logits, index):
    """TRL's bf16 path: log_softmax one batch row at a time."""
    out = []
    for row_logits, row_index in zip(logits, index):
        row_lp = F.log_softmax(row_logits, dim=-1)
        out.append(row_lp.gather(-1, row_index[..., None]).squeeze(-1))
    return torch.stack(out)


def trl_chunked_entropy(logits, chunk_size=128):
    """TRL's entropy_from_logits: rows in chunks of chunk_size, float32 softmax per chunk."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for chunk in flat.split(chunk_size, dim=0):
        lp = F.log_softmax(chunk.float(), dim=-1)
        out.append(-(lp.exp() * lp).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])


def _fwdbwd(f, x, n_out=1):
    def run():
        out = f(x)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.float().sum() for o in outs[:n_out])
        return torch.autograd.grad(loss, x)[0]

    return run


def _inputs(b, l, v, layout, gen_seed=0):
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    if layout == "strided":
        full = torch.randn(b, l + 1, v, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        x = full[:, :-1]
    else:
        x = torch.randn(b, l, v, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    idx = torch.randint(0, v, (b, l), device="cuda", generator=g)
    return x, idx


def run(report, copy_gbps, quick=False):
    shapes = SHAPES[:1] if quick else SHAPES
    for b, l, v in shapes:
        for layout in ("contiguous", "strided"):
            # fresh compiled baselines per shape and layout: a shared cache would hit dynamo's
            # recompile limit (8) across shapes x grad modes and silently fall back to eager
            torch._dynamo.reset()
            compiled_sel = torch.compile(plain_selective)
            compiled_ent = torch.compile(plain_entropy)
            x, idx = _inputs(b, l, v, layout)
            xg = x.detach().requires_grad_(True)  # a leaf with the same strides
            shape = f"B{b} L{l} V{v} {layout}"
            nbytes = x.numel() * x.element_size()

            def add(group, impl, fn, floor, peak=True, note=""):
                ms = bench_ms(fn)
                pk = peak_extra_mb(fn) if peak else None
                report.rows.append(Row(group, shape, impl, ms, floor, peak_extra_mb=pk, note=note).finish(copy_gbps))
                print(f"{group:34s} {shape:32s} {impl:26s} {ms:8.3f} ms  {report.rows[-1].frac_floor:.3f} of floor", flush=True)

            warm_up(lambda: torch_fused.logprobs_and_entropy(x, idx))
            # selective_log_softmax
            g = "selective_log_softmax fwd"
            add(g, "torch_fused", lambda: torch_fused.selective_log_softmax(x, idx), nbytes)
            add(g, "torch eager", lambda: plain_selective(x, idx), nbytes)
            add(g, "torch.compile plain", lambda: compiled_sel(x, idx), nbytes)
            add(g, "trl looped", lambda: trl_looped_selective(x, idx), nbytes)
            g = "selective_log_softmax fwd+bwd"
            add(g, "torch_fused", _fwdbwd(lambda t: torch_fused.selective_log_softmax(t, idx), xg), 3 * nbytes)
            add(g, "torch eager", _fwdbwd(lambda t: plain_selective(t, idx), xg), 3 * nbytes)
            add(g, "torch.compile plain", _fwdbwd(lambda t: compiled_sel(t, idx), xg), 3 * nbytes)
            add(g, "trl looped", _fwdbwd(lambda t: trl_looped_selective(t, idx), xg), 3 * nbytes)
            # entropy
            g = "entropy fwd"
            add(g, "torch_fused", lambda: torch_fused.entropy_from_logits(x), nbytes)
            add(g, "torch eager", lambda: plain_entropy(x), nbytes)
            add(g, "torch.compile plain", lambda: compiled_ent(x), nbytes)
            add(g, "trl chunked", lambda: trl_chunked_entropy(x), nbytes)
            g = "entropy fwd+bwd"
            add(g, "torch_fused", _fwdbwd(lambda t: torch_fused.entropy_from_logits(t), xg), 3 * nbytes)
            add(g, "torch.compile plain", _fwdbwd(lambda t: compiled_ent(t), xg), 3 * nbytes)
            # logprobs_and_entropy
            g = "logprobs_and_entropy fwd"
            add(g, "torch_fused", lambda: torch_fused.logprobs_and_entropy(x, idx), nbytes)
            add(g, "two fused calls", lambda: (torch_fused.selective_log_softmax(x, idx),
                                               torch_fused.entropy_from_logits(x)), nbytes)
            g = "logprobs_and_entropy fwd+bwd"
            add(g, "torch_fused", _fwdbwd(lambda t: torch_fused.logprobs_and_entropy(t, idx), xg, 2), 3 * nbytes)
            add(g, "two fused calls", _fwdbwd(lambda t: (torch_fused.selective_log_softmax(t, idx),
                                                         torch_fused.entropy_from_logits(t)), xg, 2), 3 * nbytes)
            del x, xg, idx
            torch.cuda.empty_cache()
    # small-input eager call overhead
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 1024, (64,), device="cuda")
    us = bench_ms(lambda: torch_fused.selective_log_softmax(x, idx)) * 1e3
    report.extra["small_call_us_selective_64x1024"] = us
    us2 = bench_ms(lambda: plain_selective(x, idx)) * 1e3
    report.extra["small_call_us_torch_eager_64x1024"] = us2
    print(f"small call 64x1024: torch_fused {us:.1f} us, torch eager {us2:.1f} us")
    # where the host time of a small call goes
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        torch_fused.selective_log_softmax(x, idx)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    # file names relative to the package roots (no paths of the machine that ran it)
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(14)
    report.extra["small_call_profile"] = buf.getvalue()[-4000:]
    print(buf.getvalue()[-2500:])


SWEEP_SHAPE = (4, 4096, 151936)
SWEEP_CONFIGS = ((1024, 2), (1024, 4), (2048, 2), (2048, 4), (4096, 4))  # (BLOCK_V, num_warps)


def sweep(copy_gbps, shape=None):
    """Time the log-prob kernels over (BLOCK_V, num_warps) on one strided bf16 shape (B, L, V),
    every kernel with the same configuration: log-probs forward, log-probs + entropy forward, and
    the backward (forward+backward minus forward). Returns a dict for ``sweep_logprobs.json``:
    the copy bandwidth, the shape and, per configuration, the times in ms and the fractions of
    the memory floor. The shipped choice is ``_CONFIGS`` in ``torch_fused/kernels/logprobs.py``."""
    b, l, v = shape or SWEEP_SHAPE
    x, idx = _inputs(b, l, v, "strided")
    xg = x.detach().requires_grad_(True)
    floor_ms = x.numel() * x.element_size() / (copy_gbps * 1e9) * 1e3
    results = []
    for block, warps in SWEEP_CONFIGS:
        with override(logprobs_block=(block, warps)):
            try:
                f = bench_ms(lambda: torch_fused.selective_log_softmax(x, idx))
                fe = bench_ms(lambda: torch_fused.logprobs_and_entropy(x, idx))
                fb = bench_ms(_fwdbwd(lambda t: torch_fused.selective_log_softmax(t, idx), xg))
            except Exception as e:  # too many registers or too much shared memory for this config
                print(f"block {block} warps {warps}: {type(e).__name__}", flush=True)
                continue
            r = dict(block=block, warps=warps, fwd=floor_ms / f, fwd_ent=floor_ms / fe, bwd=2 * floor_ms / (fb - f),
                     fwd_ms=f, fwd_ent_ms=fe, fwdbwd_ms=fb)
            results.append(r)
            print(f"block {block:5d} warps {warps}: fraction of floor: fwd {r['fwd']:.3f}  fwd_ent {r['fwd_ent']:.3f}  "
                  f"bwd {r['bwd']:.3f}", flush=True)
    return dict(copy_gbps=copy_gbps, shape=[b, l, v], results=results)
