"""The user's view of distillation: one training step of a student against a frozen teacher.

The models are bench/step.py's decoder-only transformer (RMSNorm, rotary positions, SDPA causal
attention with grouped key/value heads, SwiGLU MLP, untied lm_head; bf16 parameters, random
weights): a student of Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query and 8 key/value
heads, MLP 8192; 1.5B parameters with its untied head) and a frozen teacher of Llama-3.2-3B's
shape (28 layers, hidden 3072, 24 query and 8 key/value heads, MLP 8192), one vocabulary of
128256, sequences of 4096 tokens whose first 256 are a prompt outside the loss. One step: the
teacher's forward without gradient, the student's forward, the per-token divergence of the
student's next-token distributions from the teacher's (beta 0.5, TRL's generalized JSD) averaged
over the completion positions, backward, ``torch.optim.AdamW(fused=True)`` on the student (the
same optimizer on every path), ``zero_grad(set_to_none=True)``.

Paths (eager):
  materialized  both heads' logits ``[B, S, V]`` (bf16), ``[:, :-1]``, fp32, log_softmax and TRL's
                ``generalized_jsd_loss`` form (bench/distill.py's ``divergence_materialized``)
  trl           TRL 1.16's loss as its DistillationTrainer calls it:
                ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (its
                ``ChunkedDivergenceFunction``; on a Triton device only the completion positions
                are projected). Skipped, with the reason recorded, without trl.
  torch_fused   ``torch_fused.linear_distill(h_s, W_s, h_t, W_t, labels=..., shift=True,
                reduction="token-mean", return_entropy=True)``: the gradients formed in the
                forward pass, no projection recomputed

Before any timing the three losses and the student's lm_head gradients are computed on one batch
from the same weights and compared (``agreement`` in the results). Reported: step time, tokens/s
and peak memory (``max_memory_allocated`` over one step) at micro-batch 2 (the materialized
loss's fp32 logits of both models at 4 x 4096 tokens would be near 100 GB); then the largest
micro-batch each path fits (doubling from 1, then bisection) and tokens/s there.

``python -m torch_fused.bench distill_step`` (``--quick``: 4 layers per model, sequences of 2048,
the largest batch by doubling only); ``python -m torch_fused.bench.distill_step --device cpu
--tiny`` runs the same code with tiny models on CPU (wall-clock timing, no memory figures): a
check of the code paths, not a benchmark.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

import torch_fused

from . import common, step
from .distill import divergence_materialized

PATHS = ("materialized", "trl", "torch_fused")
OOM = step.OOM


def _student_1b():
    return step.Config(vocab=128256, layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, seq=4096,
                       prompt=256, batch=2, rope_theta=5e5, lr=1e-6)


def _teacher_3b():
    return step.Config(vocab=128256, layers=28, hidden=3072, heads=24, kv_heads=8, intermediate=8192, seq=4096,
                       prompt=256, batch=2, rope_theta=5e5)


@dataclass
class DistillConfig:
    student: step.Config = field(default_factory=_student_1b)
    teacher: step.Config = field(default_factory=_teacher_3b)
    beta: float = 0.5
    temperature: float = 1.0
    head_scale: float = 1.0  # both lm_heads' random weights times this (>1: peaked distributions)

    def check(self) -> None:
        self.student.check()
        self.teacher.check()
        for name in ("vocab", "seq", "prompt", "batch", "dtype"):
            if getattr(self.student, name) != getattr(self.teacher, name):
                raise ValueError(f"teacher.{name}: expected the student's ({getattr(self.student, name)}), got "
                                 f"{getattr(self.teacher, name)}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta: expected a value in [0, 1], got {self.beta}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {self.temperature}")


def full() -> DistillConfig:
    return DistillConfig()


def quick() -> DistillConfig:
    c = DistillConfig()
    c.student = replace(c.student, layers=4, seq=2048)
    c.teacher = replace(c.teacher, layers=4, seq=2048)
    return c


def tiny() -> DistillConfig:
    common_kw = dict(vocab=512, seq=33, prompt=8, batch=2, dtype="float32", heads=4, kv_heads=2, layers=2)
    return DistillConfig(student=replace(step.TINY, hidden=32, intermediate=64, lr=1e-3, **common_kw),
                         teacher=replace(step.TINY, hidden=48, intermediate=96, **common_kw), head_scale=40.0)


PRESETS = {"default": full, "quick": quick, "tiny": tiny}


# ---------------------------------------------------------------------------------------------
# the three losses: (student, teacher, h_s [B, S, Hs], h_t [B, S, Ht], ids, mask [B, S-1], cfg)
# -> (loss, the student's mean entropy over the mask or None)


def loss_materialized(student, teacher, h_s, h_t, ids, mask, cfg):
    t = cfg.temperature
    zs = student.lm_head(h_s)[:, :-1].float() / t
    with torch.no_grad():
        zt = teacher.lm_head(h_t)[:, :-1].float() / t
    per = divergence_materialized(zs, zt, cfg.beta)
    maskf = mask.float()
    return (per * maskf).sum() / maskf.sum().clamp_min(1), None


def loss_torch_fused(student, teacher, h_s, h_t, ids, mask, cfg):
    labels = ids[:, 1:].masked_fill(~mask, -100)
    loss, ent = torch_fused.linear_distill(h_s, student.lm_head.weight, h_t, teacher.lm_head.weight, beta=cfg.beta,
                                           temperature=cfg.temperature, labels=labels, shift=True,
                                           reduction="token-mean", return_entropy=True)
    return loss, torch_fused.masked_mean(ent, mask)


def trl_loss():
    """(the loss function, TRL's version), or the import's error."""
    import trl
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    if not getattr(_chunked_divergence_loss, "__module__", "").startswith("trl."):
        raise RuntimeError("trl's _chunked_divergence_loss is patched in this process (torch_fused.integrations.trl)")

    def loss_trl(student, teacher, h_s, h_t, ids, mask, cfg):
        # as DistillationTrainer: the hidden states aligned with the scored tokens, the loss summed
        # over the completion mask over its count
        loss, ent_sum, n = _chunked_divergence_loss(h_s[:, :-1], h_t[:, :-1], student.lm_head.weight,
                                                    teacher.lm_head.weight, mask, cfg.beta,
                                                    temperature=cfg.temperature)
        return loss, ent_sum / n.clamp_min(1)

    return loss_trl, trl.__version__


class DistillStepper:
    """One path: ``step(batch)`` runs a whole training step, returns (loss, entropy or None).
    ``model`` is the student (bench/step.py's fits() and largest_batch() use it)."""

    def __init__(self, path, student, teacher, cfg: DistillConfig, loss_fn):
        self.path, self.model, self.teacher, self.cfg, self.loss_fn = path, student, teacher, cfg, loss_fn
        self.opt = torch.optim.AdamW(student.parameters(), lr=cfg.student.lr, fused=True)
        self.block_fn = step.checkpointed(step._block_call) if cfg.student.checkpoint else None
        self.note = ""

    def loss(self, batch):
        ids, _adv, mask = batch
        with torch.no_grad():
            h_t = self.teacher.norm(self.teacher.trunk(ids))
        h_s = self.model.norm(self.model.trunk(ids, self.block_fn))
        return self.loss_fn(self.model, self.teacher, h_s, h_t, ids, mask, self.cfg)

    def step(self, batch):
        loss, ent = self.loss(batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()
        return loss.detach(), ent


def agreement(losses, student, teacher, cfg, batch, device) -> dict:
    """Each path's loss and d lm_head on one batch from the same weights, and their relative
    differences from the materialized path's (no optimizer step)."""
    out = {}
    for path, fn in losses.items():
        st = DistillStepper.__new__(DistillStepper)
        st.model, st.teacher, st.cfg, st.loss_fn = student, teacher, cfg, fn
        st.block_fn = None
        student.zero_grad(set_to_none=True)
        loss, _ = st.loss(batch)
        loss.backward()
        out[path] = dict(loss=float(loss.detach()), d_lm_head=student.lm_head.weight.grad.float().clone())
        student.zero_grad(set_to_none=True)
        step._free(device)
    ref = out.get("materialized")
    res = {}
    for path, r in out.items():
        res[path] = dict(loss=r["loss"])
        if ref is not None and path != "materialized":
            res[path]["loss_rel_diff"] = abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
            g, g0 = r["d_lm_head"].double(), ref["d_lm_head"].double()
            res[path]["d_lm_head_rel_diff"] = ((g - g0).norm() / g0.norm().clamp_min(1e-30)).item()
    return res


def measure(cfg: DistillConfig, device, *, paths=PATHS, warmup=2, reps=5, max_batch=True, max_batch_cap=128,
            bisect=True, budget_s=math.inf, log=print) -> dict:
    cfg.check()
    device = torch.device(device)
    for p in paths:
        if p not in PATHS:
            raise ValueError(f"paths: expected names from {PATHS}, got {p!r}")
    t_start = time.perf_counter()
    res = dict(config=asdict(cfg), device=str(device), equal_batch={}, largest_batch={}, skipped={}, errors={},
               versions={"torch": torch.__version__})
    losses = {"materialized": loss_materialized, "torch_fused": loss_torch_fused}
    if "trl" in paths:
        try:
            losses["trl"], res["versions"]["trl"] = trl_loss()
        except Exception as e:  # noqa: BLE001
            res["skipped"]["trl"] = f"trl not usable ({step._first_line(e)}); pip install 'trl==1.16.0'"
            log(f"trl: skipped, {res['skipped']['trl']}")
    losses = {p: losses[p] for p in PATHS if p in paths and p in losses}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    student = step.Model(cfg.student, device)
    teacher = step.Model(cfg.teacher, device).requires_grad_(False)
    # the teacher's own weights (step.Model seeds every model alike)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(1)
        for p in teacher.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, device=device, generator=g) * 0.02)
        for m in (student, teacher):
            m.lm_head.weight.mul_(cfg.head_scale)
    n_s = sum(p.numel() for p in student.parameters())
    n_t = sum(p.numel() for p in teacher.parameters())
    res.update(student_params=n_s, teacher_params=n_t,
               param_mib=sum(p.numel() * p.element_size() for m in (student, teacher) for p in m.parameters()) / 2**20)
    s, t = cfg.student, cfg.teacher
    log(f"student {n_s / 1e9:.2f}B parameters ({s.layers} layers, hidden {s.hidden}), frozen teacher {n_t / 1e9:.2f}B "
        f"({t.layers} layers, hidden {t.hidden}), vocab {s.vocab}, {s.dtype}; micro-batch {s.batch} x {s.seq} tokens")
    batch = step.make_batch(s, s.batch, device)
    try:
        res["agreement"] = agreement(losses, student, teacher, cfg, step.make_batch(s, 1, device, seed=7), device)
        log("agreement at one batch: " + json.dumps(res["agreement"]))
    except Exception as e:  # noqa: BLE001
        res["errors"]["agreement"] = step._first_line(e, 400)
        log(f"agreement: FAILED: {step._first_line(e, 400)}")
    tokens = s.batch * s.seq
    for path, fn in losses.items():
        stepper = None
        try:
            stepper = DistillStepper(path, student, teacher, cfg, fn)
            step._sync(device)
            t0 = time.perf_counter()
            stepper.step(batch)
            step._sync(device)
            first_s = time.perf_counter() - t0
            first_loss = float(stepper.last_loss)
            ms, ls, ents = step.time_steps(stepper, batch, device, max(warmup - 1, 0), reps)
            peak, base = step.peak_of_step(stepper, batch, device)
            if not all(math.isfinite(v) for v in ls + [e for e in ents if e is not None]):
                raise FloatingPointError(f"non-finite loss or entropy: {ls}, {ents}")
            res["equal_batch"][path] = dict(ms=ms, tokens_per_s=tokens / (ms * 1e-3), peak_mib=peak, held_mib=base,
                                            first_step_s=first_s, first_loss=first_loss, loss=ls[-1], entropy=ents[-1])
            pk = "" if peak is None else f"  peak {peak:8.0f} MiB (held between steps {base:.0f})"
            log(f"B{s.batch:<3d} {path:14s} {ms:9.2f} ms  {tokens / (ms * 1e-3):10.0f} tok/s{pk}  loss {ls[-1]:.4f}")
        except Exception as e:  # noqa: BLE001  (one path failing must not stop the others)
            res["errors"][path] = step._first_line(e, 400)
            log(f"B{s.batch:<3d} {path:14s} FAILED: {step._first_line(e, 400)}")
            log("".join(traceback.format_exception(e))[-1500:])
        finally:
            if stepper is not None:
                stepper.opt = None
            stepper = None
            student.zero_grad(set_to_none=True)
            step._free(device)
    if max_batch:
        searched = [p for p in losses if p in res["equal_batch"]]
        for i, path in enumerate(searched):
            stepper = big = None
            left = budget_s - (time.perf_counter() - t_start)
            deadline = time.perf_counter() + max(left, 0.0) / (len(searched) - i) * 0.6
            try:
                stepper = DistillStepper(path, student, teacher, cfg, losses[path])
                stepper.step(step.make_batch(s, 1, device))  # the optimizer state, before the search
                student.zero_grad(set_to_none=True)
                step._free(device)
                b, tries, cut = step.largest_batch(stepper, s, device, 1, max_batch_cap, bisect, deadline)
                r = dict(batch=b, tries=tries, capped=b >= max_batch_cap, cut_short=cut)
                while b > 0:
                    try:
                        big = step.make_batch(s, b, device)
                        ms, _, _ = step.time_steps(stepper, big, device, 1, max(2, reps // 2))
                        r.update(batch=b, ms=ms, tokens_per_s=b * s.seq / (ms * 1e-3))
                        break
                    except OOM:
                        big = None
                        student.zero_grad(set_to_none=True)
                        step._free(device)
                        b = b - max(1, b // 8)
                        r["note"] = "timed below the largest batch found (out of memory when timing it)"
                res["largest_batch"][path] = r
                log(f"largest micro-batch {path:14s} {r['batch']:4d}" + (" (cap)" if r["capped"] else "")
                    + (" (search cut short by the time budget)" if cut else "")
                    + (f"  {r['ms']:9.1f} ms  {r['tokens_per_s']:10.0f} tok/s" if "ms" in r else ""))
            except Exception as e:  # noqa: BLE001
                res["errors"][f"{path} largest batch"] = step._first_line(e, 400)
                log(f"largest micro-batch {path}: FAILED: {step._first_line(e, 400)}")
            finally:
                if stepper is not None:
                    stepper.opt = None
                stepper = big = None
                student.zero_grad(set_to_none=True)
                step._free(device)
    res["wall_s"] = time.perf_counter() - t_start
    return res


# ---------------------------------------------------------------------------------------------
# the suite and its files


def run(report, copy_gbps, quick=False, device="cuda"):
    cfg = (globals()["quick"] if quick else full)()
    kw = dict(reps=3, bisect=False, budget_s=150) if quick else dict(budget_s=360)
    run_config(report, cfg, quick, device, **kw)


def run_config(report, cfg, quick, device, **kw):
    res = measure(cfg, device, **kw, log=lambda s: print(s, flush=True))
    res["quick"] = quick
    report.extra["distill_step"] = res
    s = cfg.student
    shape = f"student {s.layers}L H{s.hidden}, teacher {cfg.teacher.layers}L H{cfg.teacher.hidden}, V{s.vocab} S{s.seq}"
    for path, r in res["equal_batch"].items():
        report.rows.append(common.Row(f"distillation step, micro-batch {s.batch}", shape, path, r["ms"], 0,
                                      peak_extra_mb=r["peak_mib"], note=f"{r['tokens_per_s']:.0f} tok/s"))
    for path, r in res["largest_batch"].items():
        if "ms" in r:
            report.rows.append(common.Row("distillation step, largest micro-batch", f"{shape} B{r['batch']}", path,
                                          r["ms"], 0, note=f"{r['tokens_per_s']:.0f} tok/s"))


def markdown(report) -> str:
    res = report.extra["distill_step"]
    cfg = res["config"]
    s, t = cfg["student"], cfg["teacher"]
    vers = "; ".join(f"{k} {v}" for k, v in res["versions"].items())
    lines = [
        f"Device: {report.device or res['device']}; {vers}; triton {report.triton}",
        "",
        f"One distillation training step: a student of {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads "
        f"({s['kv_heads']} key/value), MLP {s['intermediate']} ({res['student_params'] / 1e9:.2f}B parameters), "
        f"and a frozen teacher of {t['layers']} layers, hidden {t['hidden']}, {t['heads']} heads ({t['kv_heads']} "
        f"key/value), MLP {t['intermediate']} ({res['teacher_params'] / 1e9:.2f}B); vocab {s['vocab']} (untied "
        f"heads), {s['dtype']} parameters ({res['param_mib']:.0f} MiB together), random weights; sequences of "
        f"{s['seq']} tokens, the first {s['prompt']} outside the loss; beta {cfg['beta']}, temperature "
        f"{cfg['temperature']}; AdamW(fused=True) on the student on every path."
        + (" Activation checkpointing per student block." if s.get("checkpoint") else "")
        + (" Quick run (--quick): not the published configuration." if res.get("quick") else ""),
        "",
        f"At micro-batch {s['batch']} ({s['batch'] * s['seq']} tokens); peak = max_memory_allocated over one step; "
        "held = both models' parameters + the student's optimizer state between steps.",
        "",
        "| path | step ms | tokens/s | peak MiB | held MiB | first step s | loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path, r in res["equal_batch"].items():
        pk = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        hd = "" if r["held_mib"] is None else f"{r['held_mib']:.0f}"
        lines.append(f"| {path} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {pk} | {hd} | {r['first_step_s']:.1f} | "
                     f"{r['loss']:.4f} |")
    for key, err in res["errors"].items():
        lines.append(f"| {key} | | | | | | failed: {err} |")
    for path, why in res["skipped"].items():
        lines.append(f"| {path} | | | | | | skipped: {why} |")
    if res["largest_batch"]:
        lines += ["", "Largest micro-batch that fits, and tokens/s there:", "",
                  "| path | largest micro-batch | step ms | tokens/s |", "|---|---:|---:|---:|"]
        for path, r in res["largest_batch"].items():
            cap = (" (the search's cap)" if r.get("capped") else "") + (
                " (search cut short by the time budget)" if r.get("cut_short") else "")
            ms = f"{r['ms']:.1f}" if "ms" in r else ""
            tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else ""
            lines.append(f"| {path} | {r['batch']}{cap} | {ms} | {tps} |")
    if "agreement" in res:
        lines += ["", "Agreement on one batch from the same weights (relative to the materialized path):", "",
                  "| path | loss | loss rel. diff | d lm_head rel. diff |", "|---|---:|---:|---:|"]
        for path, a in res["agreement"].items():
            lines.append(f"| {path} | {a['loss']:.5f} | {a.get('loss_rel_diff', 0):.1e} | "
                         f"{a.get('d_lm_head_rel_diff', 0):.1e} |")
    lines += ["", f"Suite wall time: {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report.extra["distill_step"]
    colors = {"materialized": "tab:gray", "trl": "tab:blue", "torch_fused": "tab:green"}
    eq, lb = res["equal_batch"], res["largest_batch"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    for ax, key, title, scale in ((axes[0], "tokens_per_s", "tokens/s at the equal micro-batch", 1),
                                  (axes[1], "peak_mib", "peak GiB at the equal micro-batch", 1024)):
        ks = list(eq)
        ax.barh(range(len(ks)), [(eq[k][key] or 0) / scale for k in ks], color=[colors[k] for k in ks])
        ax.set_yticks(range(len(ks)))
        ax.set_yticklabels(ks, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=8)
    ks = [k for k in lb if "tokens_per_s" in lb[k]]
    axes[2].barh(range(len(ks)), [lb[k]["tokens_per_s"] for k in ks], color=[colors[k] for k in ks])
    axes[2].set_yticks(range(len(ks)))
    axes[2].set_yticklabels([f"{k} B{lb[k]['batch']}" for k in ks], fontsize=7)
    axes[2].invert_yaxis()
    axes[2].set_title("tokens/s at each path's largest micro-batch", fontsize=8)
    fig.suptitle(f"distillation step, {report.device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(report, out_dir: Path, name: str) -> None:
    common.save(report, out_dir, name, markdown, plot)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench.distill_step",
                                 description="The distillation training-step suite on any device; --tiny: tiny "
                                             "models (a check of the code paths, e.g. on CPU).")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, choices=tuple(PRESETS))
    ap.add_argument("--tiny", action="store_true", help="the tiny preset")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated from {','.join(PATHS)}")
    ap.add_argument("--batch", type=int, default=None, help="the micro-batch at which every path is compared")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing per student block")
    ap.add_argument("--no-max-batch", action="store_true", help="skip the largest-micro-batch search")
    ap.add_argument("--max-batch-cap", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, metavar="DIR", help="write distill_step.json/.md/.png there")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset or ("tiny" if args.tiny else "default")]()
    if args.batch is not None:
        cfg.student.batch = cfg.teacher.batch = args.batch
    cfg.student.checkpoint = args.checkpoint
    res = measure(cfg, args.device, paths=tuple(p for p in args.paths.split(",") if p), reps=args.reps,
                  max_batch=not args.no_max_batch and torch.device(args.device).type == "cuda",
                  max_batch_cap=args.max_batch_cap, log=lambda s: print(s, flush=True))
    report = common.new_report()
    report.extra["distill_step"] = res
    if args.out:
        save(report, Path(args.out), "distill_step")
    print(markdown(report))
    if res["errors"]:
        raise SystemExit(f"failed: {json.dumps(res['errors'], indent=1)}")


if __name__ == "__main__":
    main()
