"""Distillation heads, forward+backward, against the bare GEMMs of the same run and the peers.

Each shape (N token rows, vocabulary V; student hidden 2048, teacher hidden 4096 and, a second
pass, 2048; bf16; beta 0.5, temperature 1) times, forward+backward to the student's hidden states
and lm_head weight:

  torch_fused reduced      ``linear_distill(..., reduction="token-mean")``: the gradients formed in
                           the forward pass, the backward only scales them
  torch_fused reduced + entropy
                           the same with ``return_entropy=True`` (the TRL route's call)
  torch_fused per-token    ``linear_distill(..., reduction="none")`` and autograd (the backward
                           recomputes both projections)
  TRL ChunkedDivergenceFunction
                           TRL 1.16's fused head (per token, with the student's entropy), as its
                           DistillationTrainer calls it; skipped, with the reason, without trl
  Liger LigerFusedLinearJSD
                           Liger-Kernel's fused linear JSD (a mean over tokens; imported only
                           here, skipped with a note when liger_kernel is not installed)
  materialized             both heads' logits (F.linear), fp32, log_softmax, and TRL's
                           ``generalized_jsd_loss`` form (mixture by logsumexp of a stack, F.kl_div)

against the four bare GEMMs of a materialized head (teacher forward, student forward, d hidden,
d weight; bf16 with fp32 accumulation), timed right before and right after each row (their mean is
that row's floor; the clocks drift over the suite). A top-k teacher (k = 1, 20, 100, its ids and
log-probs taken from the teacher's own distribution, tail bucket, ``reduction="token-mean"``)
costs the student's head only and is timed against its three GEMMs.

Per row: the time, its multiple of the bare GEMMs, the peak memory above the inputs (the returned
gradients not counted), and the error against float64 from the same bf16 inputs on the first
``ERR_ROWS`` rows (each implementation run again on those rows): the per-token divergence's
largest error in nats where the row returns one, the loss's (the mean over the rows), and the
gradients' relative error norms as multiples of one rounding to bf16 of the float64 gradient
(1.00: as close as a correctly rounded bf16 result). The targets (PASS/FAIL in the table) are in
``bars``.

``python -m torch_fused.bench distill`` (``--quick``: the first shape, the wider teacher only);
``python -m torch_fused.bench.distill --device cpu --tiny`` runs the same code at a tiny size on
CPU (wall-clock timing, no memory figures): a check of the code paths, not a benchmark.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_fused
from torch_fused.settings import override

from . import common

SHAPES = [(8192, 151936), (16384, 128256), (32768, 32000)]  # (N, V)
STUDENT_H = 2048
TEACHER_H = (4096, 2048)  # a wider teacher, then equal widths
TOPK = (1, 20, 100)
BETA, TEMPERATURE = 0.5, 1.0
ERR_ROWS = 512
TINY = dict(shapes=[(96, 1000)], student_h=32, teacher_h=(48, 32), topk=(1, 4), err_rows=24)  # CPU-sized

# targets (bars): multiples of the bare GEMMs, the memory budget, the accuracy
BAR_REDUCED, BAR_PER_TOKEN, BAR_TOPK = 1.30, 1.65, 1.40
BAR_DIVERGENCE_NATS = 1e-5
# gradient error norm over that of one bf16 rounding of the float64 gradient: an fp32-accurate
# result rounded once to bf16 measures 1.00-1.05; 1.25 leaves room for the d logits' rounding
BAR_GRAD_ROUNDINGS = 1.25

OURS_REDUCED, OURS_REDUCED_ENT, OURS_PER_TOKEN = (
    "torch_fused reduced", "torch_fused reduced + entropy", "torch_fused per-token")
TRL, LIGER, MATERIALIZED = "TRL ChunkedDivergenceFunction", "Liger LigerFusedLinearJSD", "materialized"
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ---------------------------------------------------------------------------------------------
# the formulas and the implementations


def divergence_materialized(zs, zt, beta):
    """TRL's generalized_jsd_loss per position from logits already divided by the temperature:
    log_softmax of both, the mixture's log by a logsumexp over a stack, F.kl_div."""
    ls, lt = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    if beta == 0:
        return F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=ls.dtype, device=ls.device)
    lm = torch.logsumexp(torch.stack([ls + torch.log1p(-b), lt + torch.log(b)]), 0)
    return (beta * F.kl_div(lm, lt, reduction="none", log_target=True)
            + (1 - beta) * F.kl_div(lm, ls, reduction="none", log_target=True)).sum(-1)


def divergence_topk(zs, ids, lt_k, beta):
    """The top-k teacher's divergence with the tail bucket (TRL's _add_tail_bucket): each side's
    log-probs at the k ids and a (k+1)-th category holding the rest of the mass."""
    ls_k = F.log_softmax(zs, -1).gather(-1, ids)

    def bucket(lp):
        return torch.cat([lp, torch.log1p(-lp.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-7))], -1)

    s, t = bucket(ls_k), bucket(lt_k)
    # as logits whose log_softmax they are (each already sums to one)
    return divergence_materialized(s, t, beta)


def full_impls(beta, temperature):
    """{name: f(hs, ws, ht, wt) -> (scalar loss, per-token divergence or None)}; the peers that
    cannot be imported map to the reason instead."""
    out = {}

    def reduced(hs, ws, ht, wt):
        return torch_fused.linear_distill(hs, ws, ht, wt, beta=beta, temperature=temperature,
                                          reduction="token-mean"), None

    def reduced_ent(hs, ws, ht, wt):
        loss, _ = torch_fused.linear_distill(hs, ws, ht, wt, beta=beta, temperature=temperature,
                                             reduction="token-mean", return_entropy=True)
        return loss, None

    def per_token(hs, ws, ht, wt):
        div = torch_fused.linear_distill(hs, ws, ht, wt, beta=beta, temperature=temperature)
        return div.mean(), div

    out[OURS_REDUCED], out[OURS_REDUCED_ENT], out[OURS_PER_TOKEN] = reduced, reduced_ent, per_token
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        def trl(hs, ws, ht, wt):
            div, _ = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta, temperature)
            return div.mean(), div

        out[TRL] = trl
    except Exception as e:  # noqa: BLE001  (not installed, or another API)
        out[TRL] = f"not run: trl.kernels.chunked_divergence not importable ({type(e).__name__}: {e}); " \
                   "pip install 'trl==1.16.0'"
    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=beta, temperature=temperature)

        def liger(hs, ws, ht, wt):  # shift_labels None: every token kept (its 0.8 API takes it positionally)
            return jsd(hs, ws, ht, wt, None), None

        out[LIGER] = liger
    except Exception as e:  # noqa: BLE001
        out[LIGER] = f"not run: liger_kernel not importable ({type(e).__name__}: {e}); pip install liger-kernel"

    def materialized(hs, ws, ht, wt):
        zs = F.linear(hs, ws).float() / temperature
        zt = F.linear(ht, wt).float() / temperature
        div = divergence_materialized(zs, zt, beta)
        return div.mean(), div

    out[MATERIALIZED] = materialized
    return out


def topk_impl(beta, temperature, ids, lp, epilogue_ids=None):
    """Ours with a top-k teacher; epilogue_ids: the lm_head_epilogue_ids setting for the call (None:
    the default)."""
    def ours(hs, ws, ht=None, wt=None, rows=None):
        i, l = (ids, lp) if rows is None else (ids[:rows], lp[:rows])
        with override(**({} if epilogue_ids is None else dict(lm_head_epilogue_ids=epilogue_ids))):
            return torch_fused.linear_distill(hs, ws, teacher_topk_ids=i, teacher_topk_logprobs=l, tail="bucket",
                                              beta=beta, temperature=temperature, reduction="token-mean"), None

    return ours


@torch.no_grad()
def teacher_topk(ht, wt, k, temperature, rows_per_chunk=2048):
    """The teacher's k most likely ids per row and their log-probs (fp32), chunk by chunk."""
    ids, lps = [], []
    for r0 in range(0, ht.shape[0], rows_per_chunk):
        lt = (F.linear(ht[r0:r0 + rows_per_chunk], wt).float() / temperature).log_softmax(-1)
        lp, i = lt.topk(k, -1)
        ids.append(i)
        lps.append(lp)
    return torch.cat(ids), torch.cat(lps)


# ---------------------------------------------------------------------------------------------
# measuring


def _time_ms(fn, device, reps=3) -> float:
    """CUDA: common.bench_ms (median of at least 10 timed calls after warm-up); elsewhere the
    median wall time of ``reps`` calls (after one more where reps > 1)."""
    if device.type == "cuda":
        return common.bench_ms(fn, warmup=3, rep=100)
    if reps > 1:
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_mib(fn, minus_bytes, device):
    return common.peak_extra_mb(fn, minus_bytes) if device.type == "cuda" else None


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def reference64(hs, ws, ht, wt, beta, temperature, topk=None):
    """(per-token divergence, mean, d hidden, d weight) in float64 from the same (bf16) inputs."""
    hs64 = hs.detach().double().requires_grad_()
    ws64 = ws.detach().double().requires_grad_()
    zs = hs64 @ ws64.t() / temperature
    if topk is None:
        per = divergence_materialized(zs, (ht.detach().double() @ wt.detach().double().t()) / temperature, beta)
    else:
        per = divergence_topk(zs, topk[0], topk[1].double(), beta)
    mean = per.mean()
    dh, dw = torch.autograd.grad(mean, (hs64, ws64))
    return per.detach(), mean.detach(), dh, dw


def errors(impl, hs, ws, ht, wt, ref, rows):
    """The implementation on the first rows against the float64 reference: the largest per-token
    error (nats, or None), the loss's error (nats), the gradients' relative error norms and their
    multiples of one bf16 rounding of the reference."""
    per64, mean64, dh64, dw64 = ref
    h = hs[:rows].detach().requires_grad_()
    w = ws.detach().requires_grad_()
    kw = {} if ht is None else dict(ht=ht[:rows], wt=wt)
    loss, per = impl(h, w, **kw) if ht is not None else impl(h, w, rows=rows)
    dh, dw = torch.autograd.grad(loss, (h, w))
    out = {"divergence_err_nats": None if per is None else (per.detach().double() - per64).abs().max().item(),
           "loss_err_nats": abs(loss.item() - mean64.item())}
    for name, g, g64 in (("d_hidden", dh, dh64), ("d_weight", dw, dw64)):
        one_rounding = _rel(g64.to(g.dtype), g64)
        out[f"{name}_rel_err"] = _rel(g, g64)
        out[f"{name}_roundings"] = out[f"{name}_rel_err"] / one_rounding if one_rounding > 0 else None
    return out


def _row(res, **kw):
    res["rows"].append(kw)
    return kw


def measure(device="cuda", *, shapes=SHAPES, student_h=STUDENT_H, teacher_h=TEACHER_H, topk=TOPK, err_rows=ERR_ROWS,
            beta=BETA, temperature=TEMPERATURE, dtype=torch.bfloat16, reps=3, log=print) -> dict:
    """Every row of the suite; returns the results as a dict (what distill.json holds under
    extra["distill"]). ``reps``: timed calls per row off CUDA."""
    device = torch.device(device)
    res = dict(config=dict(shapes=[list(s) for s in shapes], student_h=student_h, teacher_h=list(teacher_h),
                           topk=list(topk), err_rows=err_rows, beta=beta, temperature=temperature, dtype=str(dtype),
                           device=str(device)),
               rows=[], skipped={}, versions={"torch": torch.__version__})
    for name in ("trl", "liger_kernel"):
        try:
            res["versions"][name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            pass
    impls = full_impls(beta, temperature)
    for name, fn in impls.items():
        if isinstance(fn, str):
            res["skipped"][name] = fn
            log(f"{name}: {fn}")
    t_start = time.perf_counter()
    for n, v in shapes:
        for t_i, th in enumerate(teacher_h):
            g = torch.Generator(device=device).manual_seed(0)
            hs = torch.randn(n, student_h, device=device, generator=g).to(dtype).requires_grad_()
            ws = (torch.randn(v, student_h, device=device, generator=g) * 2 / student_h**0.5).to(dtype).requires_grad_()
            ht = torch.randn(n, th, device=device, generator=g).to(dtype)
            wt = (torch.randn(v, th, device=device, generator=g) * 2.5 / th**0.5).to(dtype)
            shape = f"N{n} V{v} Hs{student_h} Ht{th}"
            hb, wb = hs.detach(), ws.detach()
            dl = torch.randn(n, v, device=device, generator=g).to(dtype)
            floors = {"four GEMMs": lambda: (ht @ wt.t(), hb @ wb.t(), dl @ wb, dl.t() @ hb),
                      "three student GEMMs": lambda: (hb @ wb.t(), dl @ wb, dl.t() @ hb)}
            if device.type == "cuda":
                common.warm_up(floors["four GEMMs"])
            grads_bytes = hs.numel() * hs.element_size() + ws.numel() * ws.element_size()
            logits_fp32_mib = n * v * 4 / 2**20
            dweight_fp32_mib = v * student_h * 4 / 2**20
            r = min(err_rows, n)
            ref = reference64(hs[:r], ws, ht[:r], wt, beta, temperature)
            cases = [("distill fwd+bwd", name, fn, "four GEMMs", dict(ht=ht, wt=wt), ref)
                     for name, fn in impls.items() if not isinstance(fn, str)]
            if t_i == 0:  # the top-k teacher costs the student's head only: once per shape
                for k in topk:
                    ids, lp = teacher_topk(ht, wt, min(k, v), temperature)
                    ref_k = reference64(hs[:r], ws, None, None, beta, temperature, topk=(ids[:r], lp[:r].double()))
                    cases.append((f"distill top-k fwd+bwd, k={k}", f"torch_fused top-k k={k} (tail bucket)",
                                  topk_impl(beta, temperature, ids, lp), "three student GEMMs", {}, ref_k))
                    if k > 1:  # the same with the k ids inside the head's GEMM epilogues (the other route)
                        cases.append((f"distill top-k fwd+bwd, k={k}", f"torch_fused top-k k={k} (ids in the epilogues)",
                                      topk_impl(beta, temperature, ids, lp, epilogue_ids=k), "three student GEMMs",
                                      {}, ref_k))
            for group, impl_name, fn, floor_name, kw, ref_i in cases:
                def fwdbwd(fn=fn, kw=kw):
                    loss, _ = fn(hs, ws, **kw)
                    return torch.autograd.grad(loss, (hs, ws))

                row = dict(group=group, shape=shape, impl=impl_name, floor=floor_name, n=n, v=v, student_h=student_h,
                           teacher_h=th, logits_fp32_mib=logits_fp32_mib, dweight_fp32_mib=dweight_fp32_mib)
                try:
                    ms, floor_ms = common.timed_against_floor(lambda: _time_ms(fwdbwd, device, reps),
                                                              lambda: _time_ms(floors[floor_name], device, reps))
                    peak = _peak_mib(fwdbwd, grads_bytes, device)
                    errs = errors(fn, hs, ws, kw.get("ht"), kw.get("wt"), ref_i, r)
                except OOM as e:
                    _row(res, **row, error=f"out of memory: {str(e).splitlines()[0][:200]}")
                    log(f"{group:32s} {shape:28s} {impl_name:34s} out of memory")
                    _free(device)
                    continue
                except Exception as e:  # noqa: BLE001  (a peer failing here is reported, not fatal)
                    _row(res, **row, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                    log(f"{group:32s} {shape:28s} {impl_name:34s} FAILED: {type(e).__name__}: {e}")
                    _free(device)
                    continue
                _row(res, **row, ms=ms, floor_ms=floor_ms, x_floor=ms / floor_ms, peak_extra_mib=peak, **errs)
                pk = "" if peak is None else f"  peak extra {peak:8.0f} MiB"
                div = errs["divergence_err_nats"]
                log(f"{group:32s} {shape:28s} {impl_name:34s} {ms:9.3f} ms  {ms / floor_ms:6.3f}x {floor_name}{pk}  "
                    f"err: loss {errs['loss_err_nats']:.1e}" + ("" if div is None else f", per token {div:.1e}")
                    + f", d hidden {errs['d_hidden_roundings']:.2f} / d weight {errs['d_weight_roundings']:.2f} "
                      "bf16 roundings")
                _free(device)
            del hs, ws, ht, wt, hb, wb, dl, floors, ref, cases
            _free(device)
    res["bars"] = bars(res)
    res["wall_s"] = time.perf_counter() - t_start
    for name, b in res["bars"].items():
        log(f"{b['verdict']:4s}  {name}: {b['detail']}")
    return res


# ---------------------------------------------------------------------------------------------
# targets


def bars(res) -> dict:
    """PASS/FAIL (n/a with the reason) of each target, per shape: the multiples of the bare
    GEMMs, ahead of TRL's and Liger's fused heads, peak memory, accuracy."""
    out = {}
    rows = {(r["shape"], r["impl"]): r for r in res["rows"]}
    shapes = list(dict.fromkeys(r["shape"] for r in res["rows"]))

    def put(name, ok, detail):
        out[name] = dict(verdict="n/a" if ok is None else ("PASS" if ok else "FAIL"), detail=detail)

    def timed(shape, impl):
        r = rows.get((shape, impl))
        return r if r is not None and "ms" in r else None

    for shape in shapes:
        for impl, bar in ((OURS_REDUCED, BAR_REDUCED), (OURS_PER_TOKEN, BAR_PER_TOKEN)):
            r = timed(shape, impl)
            if r is not None and r["floor"] == "four GEMMs":
                put(f"{shape}: {impl} <= {bar}x the four bare GEMMs", r["x_floor"] <= bar, f"{r['x_floor']:.3f}x")
        for impl in (OURS_REDUCED, OURS_PER_TOKEN):
            for peer in (TRL, LIGER):
                a, b = timed(shape, impl), timed(shape, peer)
                name = f"{shape}: {impl} faster than {peer}"
                if a is None or b is None:
                    if a is not None:
                        why = res["skipped"].get(peer) or (rows.get((shape, peer)) or {}).get("error") or "not measured"
                        put(name, None, why)
                    continue
                put(name, a["ms"] < b["ms"],
                    f"{a['ms']:.2f} ms vs {b['ms']:.2f} ms (ours {b['ms'] / a['ms']:.2f}x as fast)")
        for impl, extra in ((OURS_REDUCED, True), (OURS_PER_TOKEN, False)):
            r = timed(shape, impl)
            if r is None:
                continue
            budget = r["logits_fp32_mib"] / 8 + (r["dweight_fp32_mib"] if extra else 0.0)
            what = "1/8 of the [N, V] fp32 logits" + (" + the fp32 [V, Hs] d weight" if extra else "")
            if r["peak_extra_mib"] is None:
                put(f"{shape}: {impl} peak extra <= {what}", None, "no memory figures on this device")
            else:
                put(f"{shape}: {impl} peak extra <= {what}", r["peak_extra_mib"] <= budget,
                    f"{r['peak_extra_mib']:.0f} MiB vs {budget:.0f} MiB")
        r = timed(shape, OURS_PER_TOKEN)
        if r is not None:
            put(f"{shape}: {OURS_PER_TOKEN} divergence within {BAR_DIVERGENCE_NATS:g} nats of float64",
                r["divergence_err_nats"] <= BAR_DIVERGENCE_NATS, f"{r['divergence_err_nats']:.2e} nats")
        for impl in (OURS_REDUCED, OURS_PER_TOKEN):
            r = timed(shape, impl)
            if r is not None and r["d_hidden_roundings"] is not None and r["d_weight_roundings"] is not None:
                worst = max(r["d_hidden_roundings"], r["d_weight_roundings"])
                put(f"{shape}: {impl} gradients within {BAR_GRAD_ROUNDINGS}x one bf16 rounding of float64",
                    worst <= BAR_GRAD_ROUNDINGS,
                    f"d hidden {r['d_hidden_roundings']:.2f}, d weight {r['d_weight_roundings']:.2f}")
        for r in res["rows"]:
            if (r["shape"] == shape and r["floor"] == "three student GEMMs" and "ms" in r
                    and r["impl"].endswith("(tail bucket)")):
                put(f"{shape}: {r['impl']} <= {BAR_TOPK}x the student head's three bare GEMMs",
                    r["x_floor"] <= BAR_TOPK, f"{r['x_floor']:.3f}x")
    return out


# ---------------------------------------------------------------------------------------------
# the suite and its files


def run(report, copy_gbps, quick=False, device="cuda", **kw):
    """The suite, as python -m torch_fused.bench distill runs it; --quick: the first shape, the
    wider teacher only."""
    if quick:
        kw.setdefault("shapes", SHAPES[:1])
        kw.setdefault("teacher_h", TEACHER_H[:1])
    res = measure(device, **kw, log=lambda s: print(s, flush=True))
    res["quick"] = quick
    report.extra["distill"] = res
    for r in res["rows"]:
        if "ms" in r:
            report.rows.append(common.Row(r["group"], r["shape"], r["impl"], r["ms"], 0, floor_ms=r["floor_ms"],
                                          frac_floor=r["floor_ms"] / r["ms"], peak_extra_mb=r["peak_extra_mib"],
                                          note=f"{r['x_floor']:.3f}x the {r['floor']}"))


def _f(x, fmt):
    return "" if x is None else format(x, fmt)


def markdown(report) -> str:
    res = report.extra["distill"]
    cfg = res["config"]
    vers = "; ".join(f"{k} {v}" for k, v in res["versions"].items())
    lines = [
        f"Device: {report.device or cfg['device']}; {vers}; triton {report.triton}",
        "",
        f"Forward+backward to the student's hidden states and lm_head, {cfg['dtype'].replace('torch.', '')}, beta "
        f"{cfg['beta']}, temperature {cfg['temperature']}. x GEMMs: the time over the bare GEMMs of the same shape "
        "timed beside it (a full teacher: teacher forward, student forward, d hidden, d weight; a top-k teacher: the "
        "student's three). Peak: memory above the inputs during the call, the returned gradients not counted. "
        f"Errors against float64 from the same inputs on the first {cfg['err_rows']} rows: the largest per-token "
        "error (nats) where the implementation returns one, the loss's, and the gradients' error norms as multiples "
        "of one bf16 rounding of the float64 gradient."
        + (" Quick run (--quick): not the published configuration." if res.get("quick") else ""),
        "",
        "| group | shape | impl | ms | x GEMMs | peak extra MiB | logits fp32 MiB | per-token err | loss err | "
        "d hidden (roundings) | d weight (roundings) | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['group']} | {r['shape']} | {r['impl']} | | | | {r['logits_fp32_mib']:.0f} | | | | | "
                         f"{r['error']} |")
            continue
        lines.append(
            f"| {r['group']} | {r['shape']} | {r['impl']} | {r['ms']:.3f} | {r['x_floor']:.3f} | "
            f"{_f(r['peak_extra_mib'], '.0f')} | {r['logits_fp32_mib']:.0f} | {_f(r['divergence_err_nats'], '.1e')} | "
            f"{r['loss_err_nats']:.1e} | {_f(r['d_hidden_roundings'], '.2f')} | {_f(r['d_weight_roundings'], '.2f')} | "
            f"{r['floor_ms']:.3f} ms GEMMs |")
    for name, why in res["skipped"].items():
        lines.append(f"| | | {name} | | | | | | | | | {why} |")
    lines += ["", "| target | verdict | measured |", "|---|---|---|"]
    for name, b in res["bars"].items():
        lines.append(f"| {name} | {b['verdict']} | {b['detail']} |")
    lines += ["", f"Suite wall time: {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report.extra["distill"]
    rows = [r for r in res["rows"] if "ms" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(10, 1.2 + 2.4 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        rs = [r for r in rows if r["shape"] == shape]
        ax.barh(range(len(rs)), [r["x_floor"] for r in rs],
                color=["tab:green" if r["impl"].startswith("torch_fused") else "tab:gray" for r in rs])
        ax.set_yticks(range(len(rs)))
        ax.set_yticklabels([r["impl"] for r in rs], fontsize=6)
        ax.invert_yaxis()
        ax.set_title(f"{shape}: forward+backward / bare GEMMs (lower is better)", fontsize=8)
    fig.suptitle(f"distillation heads, {report.device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(report, out_dir: Path, name: str) -> None:
    common.save(report, out_dir, name, markdown, plot)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench.distill",
                                 description="The distillation suite on any device; --tiny: tiny shapes (a check of "
                                             "the code paths, e.g. on CPU).")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help=f"tiny shapes: {TINY}")
    ap.add_argument("--quick", action="store_true", help="the first shape, the wider teacher only")
    ap.add_argument("--out", default=None, metavar="DIR", help="write distill.json/.md/.png there")
    args = ap.parse_args(argv)
    report = common.new_report()
    run(report, 0.0, quick=args.quick, device=args.device, **(TINY if args.tiny else {}))
    if args.out:
        save(report, Path(args.out), "distill")
    print(markdown(report))
    failed = [r for r in report.extra["distill"]["rows"] if "error" in r]
    if failed:
        raise SystemExit(f"failed: {json.dumps(failed, indent=1)}")


if __name__ == "__main__":
    main()
