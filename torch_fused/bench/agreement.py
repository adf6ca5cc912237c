"""The fused lm_head's agreement with a sampler: what batch invariance and promoted bf16 tiles
cost, and what they buy.

For each lm_head shape (bf16 hidden states and weight):

- forward+backward time of ``linear_logprobs_and_entropy`` under the four combinations of the
  ``lm_head_batch_invariant`` and ``lm_head_promote`` settings, each as a multiple of the three
  bare GEMMs (logits, d hidden, d weight; bf16, fp32 accumulation) timed right before and after it;
- the largest log-prob and entropy error against float64 of the same inputs, on the first rows:
  the fused head with and without promotion, an fp32 head (fp32 GEMM without TF32, then
  log_softmax), and bf16 logits then log_softmax;
- the head over the sampler's support (top_k 50, top_p 0.9, both): forward+backward time as a
  multiple of the same bare GEMMs (the bar for top_k: 1.5x) and its peak extra memory, under the
  settings' current values;
- batch invariance: the first rows alone against the same rows inside the whole batch (reversed
  order), counted where the log-prob, the entropy or the d hidden row differ in any bit, with the
  setting on and off.
"""

from __future__ import annotations

import torch

import torch_fused

from ..settings import override
from .common import Row, bench_ms, head_inputs, peak_extra_mb, timed_against_floor, warm_up

SHAPES = [(8192, 4096, 151936), (16384, 3584, 151936), (32768, 4096, 32000)]  # (N, H, V)
PROBE_ROWS = 20
ERROR_ROWS = 512
COMBOS = [("invariant, promoted", True, True), ("invariant, not promoted", True, False),
          ("not invariant, promoted", False, True), ("neither", False, False)]
SUPPORT = [dict(top_k=50), dict(top_p=0.9), dict(top_k=50, top_p=0.9)]


def _errors(h, w, idx):
    """{name: (max |log-prob error|, max |entropy error|)} against float64 on h's rows."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        def head(dt, logits_dt=None):
            z = h.to(dt) @ w.to(dt).t()
            if logits_dt is not None:
                z = z.to(logits_dt)
            z = torch.log_softmax(z.double(), -1)
            return z.gather(1, idx[:, None])[:, 0], -(z.exp() * z).sum(-1)

        lp64, ent64 = head(torch.float64)
        out = {}
        for name, (lp, ent) in (("fp32 head (no TF32) + log_softmax", head(torch.float32)),
                                ("bf16 logits + log_softmax", head(torch.bfloat16, torch.bfloat16))):
            out[name] = ((lp - lp64).abs().max().item(), (ent - ent64).abs().max().item())
        for promote in (True, False):
            with override(lm_head_promote=promote):
                lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
            out[f"fused head, {'promoted' if promote else 'not promoted'}"] = (
                (lp.double() - lp64).abs().max().item(), (ent.double() - ent64).abs().max().item())
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _invariance(h, w, idx):
    """Rows (of the first PROBE_ROWS) whose log-prob, entropy or d hidden row differ between the
    row alone and the row inside the whole batch, reversed."""
    n = h.shape[0]
    rev = torch.arange(n - 1, -1, -1, device=h.device)

    def run(sel):
        hh = h[sel].detach().clone().requires_grad_(True)
        lp, ent = torch_fused.linear_logprobs_and_entropy(hh, w, idx[sel])
        (dh,) = torch.autograd.grad(lp.sum() + ent.sum(), hh)
        return lp, ent, dh

    whole = run(rev)
    diff = {"log-prob": 0, "entropy": 0, "d hidden": 0}
    for r in range(PROBE_ROWS):
        alone = run(torch.tensor([r], device=h.device))
        at = n - 1 - r
        for name, a, b in zip(diff, alone, whole):
            diff[name] += int(not torch.equal(a[0], b[at]))
    return diff


def run(report, copy_gbps, quick=False):
    for n, hd, v in SHAPES[:1] if quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        h, w, idx, dl = head_inputs(n, hd, v, g)
        shape = f"N{n} H{hd} V{v}"
        hb, wb = h.detach(), w.detach()

        def floor():
            return hb @ wb.t(), dl @ wb, dl.t() @ hb

        def fused():
            lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx)
            return torch.autograd.grad(lp.sum() + ent.sum(), (h, w))

        warm_up(floor)
        times = {}
        for name, inv, promote in COMBOS:
            with override(lm_head_batch_invariant=inv, lm_head_promote=promote):
                warm_up(fused, ms=100.0)
                ms, floor_ms = timed_against_floor(lambda: bench_ms(fused, warmup=5, rep=100), lambda: bench_ms(floor))
            times[name] = ms / floor_ms
            row = Row("lm_head fwd+bwd (agreement settings)", shape, name, ms, 0,
                      note=f"{ms / floor_ms:.3f}x the bare GEMMs ({floor_ms:.3f} ms beside it)")
            row.floor_ms, row.frac_floor = floor_ms, floor_ms / ms
            report.rows.append(row)
            print(f"{shape:22s} {name:32s} {ms:8.3f} ms  {ms / floor_ms:.3f}x GEMMs", flush=True)
        for kw in SUPPORT:  # the head over the sampler's support (token-row chunks), default settings
            name = "sampler support " + " ".join(f"{k}={v}" for k, v in kw.items())

            def support(kw=kw):
                lp, ent = torch_fused.linear_logprobs_and_entropy(h, w, idx, **kw)
                return torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum() + ent.sum(), (h, w))

            warm_up(support, ms=100.0)
            ms, floor_ms = timed_against_floor(lambda: bench_ms(support, warmup=3, rep=30), lambda: bench_ms(floor))
            pk = peak_extra_mb(support)
            times[name] = ms / floor_ms
            row = Row("lm_head fwd+bwd (agreement settings)", shape, name, ms, 0, peak_extra_mb=pk,
                      note=f"{ms / floor_ms:.3f}x the bare GEMMs ({floor_ms:.3f} ms beside it); bar 1.5x for top_k")
            row.floor_ms, row.frac_floor = floor_ms, floor_ms / ms
            report.rows.append(row)
            print(f"{shape:22s} {name:32s} {ms:8.3f} ms  {ms / floor_ms:.3f}x GEMMs  {pk:.0f} MiB", flush=True)
        del dl
        torch.cuda.empty_cache()
        errs = _errors(hb[:ERROR_ROWS], wb, idx[:ERROR_ROWS])
        for name, (e_lp, e_ent) in errs.items():
            report.rows.append(Row("lm_head error vs float64", shape, name, 0.0, 0,
                                   note=f"max |log-prob error| {e_lp:.2e}, max |entropy error| {e_ent:.2e} "
                                   f"({ERROR_ROWS} rows)"))
            print(f"{shape:22s} {name:36s} log-prob {e_lp:.2e}  entropy {e_ent:.2e}", flush=True)
        torch.cuda.empty_cache()
        for inv in (True, False):
            with override(lm_head_batch_invariant=inv):
                diff = _invariance(hb, wb, idx)
            name = f"rows differing alone vs in batch, invariant {'on' if inv else 'off'}"
            report.rows.append(Row("lm_head batch invariance", shape, name, 0.0, 0,
                                   note=", ".join(f"{k} {c}/{PROBE_ROWS}" for k, c in diff.items())))
            print(f"{shape:22s} {name}: {diff}", flush=True)
        report.extra.setdefault("agreement", {})[shape] = {"ratios": times, "errors": errs}
        del h, w, hb, wb, idx
        torch.cuda.empty_cache()
