"""Our SinkGD beside axolotl's, in training: the same model, data, batches, schedule and
hyperparameters, plain and spectral, so the loss curves show whether the two implement one
algorithm (axolotl's optimizer is the implementation this library's SinkGD follows).

``python -m torch_fused.bench.seed_compare [--device cpu|cuda] [--seeds 3] [--out DIR]``

Needs axolotl's optimizer module and torchao: ``pip install --no-deps axolotl torchao``. Neither
is a dependency of torch_fused; axolotl's package-level imports of peft and transformers are not
needed by its optimizer and are stubbed when absent. The model and the training loop are
``torch_fused.bench.train``'s (a byte-level LLaMA-style LM on the standard library's sources).

Both sides put SinkGD on the blocks' matrices (``sinkgd_param_groups``) and AdamW on the rest:
ours through SinkGD's AdamW fallback; axolotl's optimizer gets only the matrices (its fallback is
torchao's 8-bit AdamW, a different optimizer), the rest a ``torch.optim.AdamW`` with the same
settings. axolotl's step runs its ``torch.compile``d PyTorch path (``--eager``: the same
functions uncompiled, on slow hosts). Run-to-run noise is measured, not assumed: ours at
``--seeds`` seeds (initialization and batch order); the report gives, per setting, the largest
difference between the two implementations' validation losses at the same seed and the spread
of ours across seeds at the same points.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import torch

from . import train as T

CONFIG = dict(width=128, depth=2, seq=64, batch=16, steps=240, warmup=20, eval_every=20, eval_batches=8,
              data_mb=2, adamw_lr=2e-3)
SETTINGS = {"plain": dict(lr=0.02), "spectral": dict(lr=1.0, spectral_norm=True, spectral_target="muon")}


def load_axolotl_sinkgd():
    """axolotl's SinkGD class, importing only its optimizer module."""
    if importlib.util.find_spec("axolotl") is None or importlib.util.find_spec("torchao") is None:
        raise SystemExit("seed_compare needs axolotl's optimizer and torchao: pip install --no-deps axolotl torchao")
    name = "axolotl.integrations.base"
    if name not in sys.modules and importlib.util.find_spec("peft") is None:
        stub = types.ModuleType(name)  # only its BaseOptimizerFactory base class is used, by a factory we skip
        stub.BaseOptimizerFactory = object
        sys.modules[name] = stub
    return importlib.import_module("axolotl.utils.optimizers.sinkgd").SinkGD


class _Pair:
    """Two optimizers stepped as one, their param groups in one list (the schedule scales each
    group's lr)."""

    def __init__(self, *opts):
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]

    @property
    def state(self):
        return {k: v for o in self.opts for k, v in o.state.items()}

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def make_pair(cls, setting, eager):
    """An optimizer factory for train.train_one: "ours" or axolotl's SinkGD (+ AdamW)."""
    s = dict(SETTINGS[setting])
    lr = s.pop("lr")

    def make(name, model, lr_, adamw_lr):
        from torch_fused.optim import SinkGD, sinkgd_param_groups

        groups = sinkgd_param_groups(model, lr=adamw_lr, betas=(0.9, 0.95), weight_decay=0.0)
        if cls is None:
            return SinkGD(groups, lr=lr, fallback_kwargs={"lr": adamw_lr, "betas": (0.9, 0.95)}, **s)
        opt = cls([dict(params=groups[0]["params"], use_sinkgd=True)], lr=lr, weight_decay=0.0,
                  sinkhorn_iters=5, sinkgd_lr_scale=0.05, sinkgd_spectral_norm=s.get("spectral_norm", False),
                  sinkgd_spectral_target=s.get("spectral_target", "unit"), sinkgd_spectral_norm_iters=1)
        if eager:  # the functions its compiled step wraps, called directly
            mod = sys.modules[cls.__module__]
            opt._compiled_sinkgd = mod.single_param_sinkgd
            opt._compiled_sinkgd_sn = mod.single_param_sinkgd_specnorm
        adamw = torch.optim.AdamW(groups[1]["params"], lr=adamw_lr, betas=(0.9, 0.95), weight_decay=0.0)
        return _Pair(opt, adamw)

    return make


def compare(cfg, device, seeds, eager, log=print, cls=None) -> dict:
    cls = cls or load_axolotl_sinkgd()
    train, val, info = T.corpus(cfg["data_mb"])
    res = dict(config=dict(cfg, seeds=seeds, eager=eager), data=info, device=str(device), settings={})
    for setting in SETTINGS:
        runs = {}
        for impl, c in (("torch_fused", None), ("axolotl", cls)):
            for seed in range(seeds if impl == "torch_fused" else 1):
                t0 = time.perf_counter()
                r = T.train_one(f"sinkgd {setting}", cfg["width"], SETTINGS[setting]["lr"], cfg["adamw_lr"], train, val,
                                cfg, device, seed=seed, make=make_pair(c, setting, eager))
                runs[f"{impl} seed {seed}"] = r
                log(f"{setting:9s} {impl:12s} seed {seed}: val {r['val']:.4f} ({time.perf_counter() - t0:.0f} s)")
        ours0 = runs["torch_fused seed 0"]["curve"]
        axo = runs["axolotl seed 0"]["curve"]
        diff = max(abs(a[1] - b[1]) for a, b in zip(ours0, axo))
        spread = max(max(runs[f"torch_fused seed {s}"]["curve"][i][1] for s in range(seeds))
                     - min(runs[f"torch_fused seed {s}"]["curve"][i][1] for s in range(seeds))
                     for i in range(len(ours0))) if seeds > 1 else float("nan")
        res["settings"][setting] = dict(max_abs_diff=diff, seed_spread=spread, final_ours=ours0[-1][1],
                                        final_axolotl=axo[-1][1], runs=runs)
        log(f"{setting}: largest |ours - axolotl| {diff:.4f} nats; spread of ours over {seeds} seeds {spread:.4f}")
    return res


def markdown(res) -> str:
    cfg = res["config"]
    lines = [f"SinkGD, ours against axolotl's, {res['device']}: width {cfg['width']}, depth {cfg['depth']}, "
             f"sequences of {cfg['seq']}, batch {cfg['batch']}, {cfg['steps']} steps, AdamW lr {cfg['adamw_lr']} on the "
             f"rest; axolotl {'eager' if cfg['eager'] else 'compiled'}.", "",
             "| setting | lr | final val, ours (seed 0) | axolotl (seed 0) | largest difference on the curve | "
             f"spread of ours over {cfg['seeds']} seeds |", "|---|---:|---:|---:|---:|---:|"]
    for name, s in res["settings"].items():
        lines.append(f"| {name} | {SETTINGS[name]['lr']} | {s['final_ours']:.4f} | {s['final_axolotl']:.4f} | "
                     f"{s['max_abs_diff']:.4f} | {s['seed_spread']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench.seed_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of ours, for the run-to-run spread (default 3)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eager", action="store_true", help="axolotl's step functions uncompiled")
    ap.add_argument("--out", default=None, help="result folder (default: a new torch_fused_seed_compare_<time>)")
    args = ap.parse_args(argv)
    cfg = dict(CONFIG)
    if args.steps:
        cfg["steps"] = args.steps
    res = compare(cfg, torch.device(args.device), args.seeds, args.eager)
    out = Path(args.out or time.strftime("torch_fused_seed_compare_%Y%m%d_%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "seed_compare.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "seed_compare.md").write_text(markdown(res))
    print(markdown(res))
    print(f"results written to {out.resolve()}")
    return res


if __name__ == "__main__":
    main()
