"""Training quality: SinkGD against AdamW at equal tokens on a small language model.

``python -m torch_fused.bench train`` (or ``python -m torch_fused.bench.train`` on any device;
``--quick`` for a CPU-sized smoke run). A small deterministic experiment:

- Data: the ``.py`` files of the running Python's standard library, byte-level (vocabulary 256),
  split into train and validation by file (a file is validation when the CRC32 of its path
  relative to the library is 0 mod 10), files in sorted order, joined by a 0 byte. Every machine
  with Python has it; nothing is downloaded.
- Model: a LLaMA-style decoder (RMSNorm, SwiGLU MLP of width 8/3 d rounded to 64, rotary
  positions, untied head, no biases), ``depth`` blocks, at several widths (heads of 64).
- Runs: every optimizer sees the same batches (one seed) for the same steps; warm-up then
  cosine decay to 10% of the peak lr. AdamW (``torch.optim.AdamW``, betas 0.9 / 0.95, weight
  decay 0.1 on matrices) is swept first; the SinkGD variants get the paper's split (SinkGD on
  the blocks' matrices, AdamW at AdamW's best lr of that width on the embedding, the head and
  the vectors: ``sinkgd_param_groups``) and their own lr sweep. The sweep is widened (a factor
  of 2 at a time, up to ``max_extend`` times) while the best lr sits at an edge.
- Report: the best validation loss per optimizer and width and its lr, every sweep point, the
  tokens each optimizer needs to reach AdamW's final validation loss, the last hidden state's
  RMS (before the final norm) at the best lr and at 4x it where that point was run, the
  optimizer step time and the optimizer state's bytes, and every run's validation curve.
"""

from __future__ import annotations

import math
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import common

# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------
FULL = dict(widths=(256, 512, 1024), depth=4, seq=256, batch=32, steps=600, warmup=30, eval_every=50,
            eval_batches=16, data_mb=24,
            lrs={"adamw": (1e-3, 2e-3, 4e-3, 8e-3), "sinkgd": (4e-2, 8e-2, 1.6e-1, 3.2e-1),
                 "sinkgd_spectral": (0.5, 1.0, 2.0, 4.0)},
            max_extend=2)
QUICK = dict(widths=(32, 64), depth=2, seq=32, batch=4, steps=6, warmup=2, eval_every=3, eval_batches=2,
             data_mb=0.25, lrs={"adamw": (2e-3, 8e-3), "sinkgd": (0.1, 0.4), "sinkgd_spectral": (1.0, 4.0)},
             max_extend=0)
OPTIMIZERS = ("adamw", "sinkgd", "sinkgd_spectral")
# opt-in (--optimizers adds them): plain SinkGD with base_width set to the experiment's smallest
# width (its lr then means the same step size at every width, by the 1 / n rule); and the control
# for the SinkGD runs' parameter split, AdamW on every parameter with the same split: the hidden
# matrices at the swept lr, the embedding, head and vectors at the lr the SinkGD runs give them
EXTRA_OPTIMIZERS = ("sinkgd_base_width", "adamw_split")
VAL_MOD = 10  # one file in ten (by CRC32 of its path) is validation


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
def corpus(max_mb: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, description) from the standard library's .py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    cap = int(max_mb * 2**20)
    for p in files:
        rel = p.relative_to(root).as_posix()
        val = zlib.crc32(rel.encode()) % VAL_MOD == 0
        if sizes[val] >= (cap // VAL_MOD if val else cap):
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        parts[val].append(data + b"\0")
        sizes[val] += len(data) + 1
    as_t = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()  # noqa: E731
    info = dict(root=str(root), files=len(parts[False]) + len(parts[True]), train_bytes=sizes[False],
                val_bytes=sizes[True], val_files=len(parts[True]))
    return as_t(parts[False]), as_t(parts[True]), info


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """An endless stream of [batch, seq + 1] windows at random offsets, the same for every run."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([data[s:s + seq + 1] for s in starts.tolist()])


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


def rotary(x, cos, sin):
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        hidden = 64 * math.ceil(8 * d / 3 / 64)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        g, u = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class LM(nn.Module):
    def __init__(self, d, depth, seq, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(depth))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // max(1, d // 64)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.arange(seq).float()[:, None] * inv[None]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for blk in self.blocks:  # residual projections scaled by depth (GPT-2 style)
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * depth))
            nn.init.normal_(blk.down.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, self.cos[:t], self.sin[:t])
        self.last_hidden_rms = x.detach().float().pow(2).mean().sqrt()
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------
def make_optimizer(name, model, lr, adamw_lr, base_width=None):
    from torch_fused.optim import SinkGD, sinkgd_param_groups

    if name == "adamw":
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        fused = next(model.parameters()).is_cuda
        return torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)],
                                 lr=lr, betas=(0.9, 0.95), fused=fused or None)
    groups = sinkgd_param_groups(model, lr=adamw_lr, betas=(0.9, 0.95), weight_decay=0.0)
    if name == "adamw_split":
        for g in groups:
            if not g.pop("use_fallback", False):
                g.update(lr=lr, weight_decay=0.1)  # the hidden matrices, as in the adamw runs
        fused = next(model.parameters()).is_cuda
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused or None)
    kw = dict(spectral_norm=True, spectral_target="muon") if name == "sinkgd_spectral" else {}
    if name == "sinkgd_base_width":
        kw = dict(base_width=base_width)
    return SinkGD(groups, lr=lr, fallback_kwargs={"lr": adamw_lr, "betas": (0.9, 0.95)}, **kw)


def partial_make(cfg):
    """make_optimizer with the experiment's smallest width as base_width."""
    return lambda name, model, lr, adamw_lr: make_optimizer(name, model, lr, adamw_lr, min(cfg["widths"]))


def state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


@torch.no_grad()
def evaluate(model, val, cfg, device) -> float:
    model.eval()
    stream = batches(val, cfg["batch"], cfg["seq"], seed=1234)
    tot = 0.0
    for _ in range(cfg["eval_batches"]):
        xb = next(stream).to(device)
        tot += F.cross_entropy(model(xb[:, :-1]).float().flatten(0, 1), xb[:, 1:].flatten()).item()
    model.train()
    return tot / cfg["eval_batches"]


def train_one(name, width, lr, adamw_lr, train, val, cfg, device, seed=0, make=None) -> dict:
    """One run; ``make(name, model, lr, adamw_lr)`` builds the optimizer (default make_optimizer)."""
    torch.manual_seed(seed)
    model = LM(width, cfg["depth"], cfg["seq"]).to(device)
    opt = (make or partial_make(cfg))(name, model, lr, adamw_lr)
    base = [g["lr"] for g in opt.param_groups]
    fb = [dict(g.get("fallback_kwargs") or {}) for g in opt.param_groups]
    steps, warm = cfg["steps"], cfg["warmup"]
    stream = batches(train, cfg["batch"], cfg["seq"], seed=seed)
    curve, opt_ms = [], []
    tokens_per_step = cfg["batch"] * cfg["seq"]
    # bf16 autocast: on CUDA by default, on a CPU with --set amp=1
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(cfg.get("amp", device.type == "cuda")))
    loss_v = float("nan")
    for step in range(steps):
        f = (step + 1) / warm if step < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
        for g, b0, k in zip(opt.param_groups, base, fb):
            g["lr"] = b0 * f
            if "lr" in k:
                g["fallback_kwargs"]["lr"] = k["lr"] * f
        xb = next(stream).to(device)
        with amp:
            logits = model(xb[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), xb[:, 1:].flatten())
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        opt_ms.append((time.perf_counter() - t0) * 1e3)
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        if not math.isfinite(loss_v):
            break
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
            with amp:
                curve.append(((step + 1) * tokens_per_step, evaluate(model, val, cfg, device)))
    with amp, torch.no_grad():
        model(next(batches(val, cfg["batch"], cfg["seq"], seed=99)).to(device)[:, :-1])
    ms = sorted(opt_ms[len(opt_ms) // 4:]) or [float("nan")]
    final = curve[-1][1] if curve and math.isfinite(loss_v) else float("nan")
    return dict(optimizer=name, width=width, lr=lr, adamw_lr=adamw_lr, val=final, curve=curve,
                last_train_loss=loss_v, hidden_rms=float(model.last_hidden_rms),
                opt_step_ms=ms[len(ms) // 2], state_bytes=state_bytes(opt),
                params=sum(p.numel() for p in model.parameters()))


def sweep(name, width, lrs, adamw_lr, train, val, cfg, device, log, prior=()) -> list[dict]:
    """Runs at lrs, widened by factors of 2 while the best is at an edge (max_extend times).
    ``prior``: runs of an earlier result with the same configuration, reused at their lr (a run
    is deterministic: it would give the same numbers)."""
    runs = {r["lr"]: r for r in prior if r.get("adamw_lr") == adamw_lr}

    def run(lr):
        if lr not in runs:
            r = train_one(name, width, lr, adamw_lr, train, val, cfg, device)
            runs[lr] = r
            log(f"train {name:16s} width {width:5d} lr {lr:<8.3g} val {r['val']:.4f} hidden RMS "
                f"{r['hidden_rms']:.3g} opt step {r['opt_step_ms']:.2f} ms")
        return runs[lr]

    for lr in lrs:
        run(lr)
    for _ in range(cfg["max_extend"]):
        order = sorted(runs)
        best = min(order, key=lambda x: (not math.isfinite(runs[x]["val"]), runs[x]["val"]))
        if best == order[0]:
            run(order[0] / 2)
        elif best == order[-1]:
            run(order[-1] * 2)
        else:
            break
    return [runs[k] for k in sorted(runs)]


def best_of(runs):
    ok = [r for r in runs if math.isfinite(r["val"])]
    return min(ok, key=lambda r: r["val"]) if ok else None


def tokens_to_reach(curve, target):
    for tokens, v in curve:
        if v <= target:
            return tokens
    return None


# the settings a run's numbers depend on: a resumed result must match them
RUN_KEYS = ("depth", "seq", "batch", "steps", "warmup", "eval_every", "eval_batches", "data_mb", "amp")


def experiment(cfg, device, log=print, optimizers=OPTIMIZERS, on_width=None, resume=None) -> dict:
    """``resume``: an earlier result (train.json's ``extra["train"]``) whose runs are reused
    where the configuration and the lr match; the sweeps extend it."""
    if resume is not None:
        diff = {k: (resume["config"].get(k), cfg.get(k)) for k in RUN_KEYS if resume["config"].get(k) != cfg.get(k)}
        if diff:
            raise SystemExit(f"--resume: the earlier result ran other settings (earlier, now): {diff}")
    train, val, info = corpus(cfg["data_mb"])
    log(f"data: {info['files']} files of {info['root']}, {info['train_bytes'] / 2**20:.1f} MiB train, "
        f"{info['val_bytes'] / 2**20:.2f} MiB validation ({info['val_files']} files)")
    res = dict(config={k: v for k, v in cfg.items()}, data=info, device=str(device), widths={})
    for width in cfg["widths"]:
        per = {}
        prior = resume["widths"].get(str(width), {}).get("runs", {}) if resume is not None else {}
        adamw_runs = sweep("adamw", width, cfg["lrs"]["adamw"], None, train, val, cfg, device, log,
                           prior.get("adamw", ()))
        per["adamw"] = adamw_runs
        adamw_best = best_of(adamw_runs)
        adamw_lr = adamw_best["lr"] if adamw_best else cfg["lrs"]["adamw"][0]
        adamw_lr *= cfg.get("fallback_lr_scale", 1)  # the SinkGD runs' AdamW part: AdamW's best lr times this
        for name in optimizers:
            if name != "adamw":
                per[name] = sweep(name, width, cfg["lrs"][name], adamw_lr, train, val, cfg, device, log,
                                  prior.get(name, ()))
        summary = {}
        target = adamw_best["val"] if adamw_best else float("nan")
        for name, runs in per.items():
            b = best_of(runs)
            if b is None:
                summary[name] = dict(best_lr=None, val=float("nan"))
                continue
            four = [r for r in runs if math.isclose(r["lr"], 4 * b["lr"], rel_tol=1e-6)]
            lrs = [r["lr"] for r in runs]
            summary[name] = dict(
                best_lr=b["lr"], val=b["val"], at_edge=b["lr"] in (min(lrs), max(lrs)),
                tokens_to_adamw_final=tokens_to_reach(b["curve"], target),
                hidden_rms_best=b["hidden_rms"], hidden_rms_4x=four[0]["hidden_rms"] if four else None,
                opt_step_ms=b["opt_step_ms"], state_mib=b["state_bytes"] / 2**20, params=b["params"])
        res["widths"][str(width)] = dict(runs=per, summary=summary)
        if on_width is not None:  # results so far, written as each width finishes
            on_width(res)
    return res


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def markdown(report) -> str:
    res = report.extra["train"]
    cfg = res["config"]
    toks = cfg["steps"] * cfg["batch"] * cfg["seq"]
    lines = [
        f"Device: {report.device}; torch {report.torch}; triton {report.triton}",
        "",
        f"Byte-level LM on {res['data']['files']} standard-library files ({res['data']['train_bytes'] / 2**20:.1f} "
        f"MiB train, {res['data']['val_bytes'] / 2**20:.2f} MiB validation, split by file), LLaMA-style, depth "
        f"{cfg['depth']}, sequences of {cfg['seq']}, batch {cfg['batch']}, {cfg['steps']} steps ({toks / 1e6:.2f}M "
        f"tokens) per run, warm-up {cfg['warmup']} then cosine to 10%, one seed."
        + (" Quick run: not the published configuration." if cfg.get("quick") else ""),
        "",
        "| width | optimizer | best lr | val loss | lr at sweep edge | tokens to AdamW's final loss | hidden RMS "
        "(best / 4x lr) | opt step ms | state MiB |",
        "|---:|---|---:|---:|---|---:|---|---:|---:|",
    ]
    for width, w in res["widths"].items():
        for name, s in w["summary"].items():
            if s.get("best_lr") is None:
                lines.append(f"| {width} | {name} | - | diverged | | | | | |")
                continue
            tt = s["tokens_to_adamw_final"]
            four = "-" if s["hidden_rms_4x"] is None else f"{s['hidden_rms_4x']:.3g}"
            lines.append(
                f"| {width} | {name} | {s['best_lr']:.3g} | {s['val']:.4f} | {'yes' if s['at_edge'] else 'no'} | "
                f"{'not reached' if tt is None else f'{tt / 1e6:.2f}M'} | {s['hidden_rms_best']:.3g} / {four} | "
                f"{s['opt_step_ms']:.2f} | {s['state_mib']:.1f} |")
    lines += ["", "Every sweep point (validation loss):", "", "| width | optimizer | lr | val loss | hidden RMS |",
              "|---:|---|---:|---:|---:|"]
    for width, w in res["widths"].items():
        for name, runs in w["runs"].items():
            for r in runs:
                lines.append(f"| {width} | {name} | {r['lr']:.3g} | {r['val']:.4f} | {r['hidden_rms']:.3g} |")
    return "\n".join(lines) + "\n"


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report.extra["train"]
    widths = list(res["widths"])
    fig, axes = plt.subplots(2, len(widths), figsize=(5 * len(widths), 8), squeeze=False)
    for j, width in enumerate(widths):
        w = res["widths"][width]
        for name, runs in w["runs"].items():
            ok = [r for r in runs if math.isfinite(r["val"])]
            axes[0][j].plot([r["lr"] for r in ok], [r["val"] for r in ok], "o-", label=name)
            b = best_of(runs)
            if b:
                axes[1][j].plot([t / 1e6 for t, _ in b["curve"]], [v for _, v in b["curve"]],
                                label=f"{name} lr {b['lr']:.3g}")
        axes[0][j].set_xscale("log")
        axes[0][j].set_title(f"width {width}: final val loss vs lr")
        axes[1][j].set_title(f"width {width}: val loss at the best lr")
        axes[1][j].set_xlabel("tokens (M)")
        for ax in axes[:, j]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def save(report, out_dir: Path, name: str) -> None:
    common.save(report, out_dir, name, markdown, plot)


def new_report(device) -> common.Report:
    r = common.new_report()
    r.device = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return r


def run(report, copy_gbps, quick=False):
    """The suite runner's entry (python -m torch_fused.bench train)."""
    cfg = dict(QUICK if quick else FULL, quick=quick)
    report.extra["train"] = experiment(cfg, torch.device("cuda"), log=lambda s: print(s, flush=True))


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny widths, a few steps: a smoke run (CPU)")
    ap.add_argument("--widths", default=None, help="comma-separated widths (default: the configuration's)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lrs", action="append", default=[], metavar="OPT=LR,LR,...",
                    help="the starting lr grid of one optimizer (adamw, sinkgd, sinkgd_spectral); repeatable")
    ap.add_argument("--max-extend", type=int, default=None, help="how many times a sweep may widen (default 2)")
    ap.add_argument("--out", default=None, help="result folder (default: a new torch_fused_bench_train_<time>)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                    help=f"comma-separated, adamw first (its best lr sets the AdamW part of the others): of "
                         f"{', '.join(OPTIMIZERS + EXTRA_OPTIMIZERS)} (default: {','.join(OPTIMIZERS)})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one setting of the configuration (depth, seq, batch, warmup, eval_every, "
                         "eval_batches, data_mb; amp=1/0: bf16 autocast, on by default on CUDA only; "
                         "fallback_lr_scale: the SinkGD runs' AdamW part at AdamW's best lr times this, default 1); "
                         "repeatable")
    ap.add_argument("--resume", default=None, metavar="TRAIN_JSON",
                    help="an earlier train.json of the same settings: its runs are reused at their lr, only new "
                         "sweep points are trained (e.g. a sweep extended with --lrs)")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL, quick=args.quick)
    if args.widths:
        cfg["widths"] = tuple(int(w) for w in args.widths.split(","))
    if args.steps:
        cfg["steps"] = args.steps
    if args.max_extend is not None:
        cfg["max_extend"] = args.max_extend
    for spec in args.set:
        key, _, val = spec.partition("=")
        if key not in ("depth", "seq", "batch", "warmup", "eval_every", "eval_batches", "data_mb", "amp",
                       "fallback_lr_scale") or not val:
            raise SystemExit(f"--set: expected KEY=VALUE with KEY one of depth, seq, batch, warmup, eval_every, "
                             f"eval_batches, data_mb, amp, fallback_lr_scale; got {spec!r}")
        cfg[key] = float(val) if key in ("data_mb", "fallback_lr_scale") else int(val)
    names = tuple(n for n in args.optimizers.split(",") if n)
    if not names or names[0] != "adamw" or any(n not in OPTIMIZERS + EXTRA_OPTIMIZERS for n in names):
        raise SystemExit(f"--optimizers: adamw first, then any of {', '.join(OPTIMIZERS[1:] + EXTRA_OPTIMIZERS)}; "
                         f"got {args.optimizers!r}")
    cfg["lrs"] = dict(cfg["lrs"], sinkgd_base_width=cfg["lrs"]["sinkgd"], adamw_split=cfg["lrs"]["adamw"])
    for spec in args.lrs:
        name, _, vals = spec.partition("=")
        if name not in OPTIMIZERS + EXTRA_OPTIMIZERS or not vals:
            raise SystemExit(f"--lrs: expected OPT=LR,LR,... with OPT one of {', '.join(OPTIMIZERS + EXTRA_OPTIMIZERS)}, "
                             f"got {spec!r}")
        cfg["lrs"][name] = tuple(float(v) for v in vals.split(","))
    device = torch.device(args.device)
    report = new_report(device)
    out = Path(args.out or time.strftime("torch_fused_bench_train_%Y%m%d_%H%M%S"))

    def partial(res):
        report.extra["train"] = res
        save(report, out, "train")

    resume = None
    if args.resume:
        import json

        resume = json.loads(Path(args.resume).read_text())["extra"]["train"]
    report.extra["train"] = experiment(cfg, device, log=lambda s: print(s, flush=True), optimizers=names,
                                       on_width=partial, resume=resume)
    save(report, out, "train")
    print(markdown(report))
    print(f"results written to {out.resolve()}")
    return report


if __name__ == "__main__":
    main()
