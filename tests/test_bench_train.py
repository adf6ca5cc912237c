"""python -m torch_fused.bench.train at CPU size: the data split, the sweep's edge rule and a whole
(tiny) experiment, every optimizer finite, the report's tables."""

from __future__ import annotations

import math

import pytest
import torch

from torch_fused._library import INTERPRET
from torch_fused.bench import train as T

pytestmark = pytest.mark.skipif(INTERPRET, reason="training loops: the plain CPU run covers them")


def test_corpus_is_split_by_file_and_deterministic():
    tr, va, info = T.corpus(0.2)
    tr2, va2, _ = T.corpus(0.2)
    assert torch.equal(tr, tr2) and torch.equal(va, va2)
    assert info["val_files"] >= 1 and info["files"] > info["val_files"]
    assert tr.numel() == info["train_bytes"] and va.numel() == info["val_bytes"]
    assert int(tr.max()) < 256 and int(tr.min()) >= 0


def test_sweep_widens_while_the_best_lr_is_at_an_edge(monkeypatch):
    """A best lr at the top of the sweep runs 2x it next, at the bottom 1/2 x, up to max_extend."""
    seen = []

    def fake(name, width, lr, adamw_lr, train, val, cfg, device, seed=0):
        seen.append(lr)
        return dict(val=abs(math.log2(lr / 8.0)), hidden_rms=1.0, opt_step_ms=0.0, lr=lr)

    monkeypatch.setattr(T, "train_one", fake)
    runs = T.sweep("adamw", 8, (1.0, 2.0), None, None, None, dict(max_extend=5), None, lambda s: None)
    assert seen == [1.0, 2.0, 4.0, 8.0, 16.0]  # stops once 8 is interior
    assert T.best_of(runs)["lr"] == 8.0


def test_quick_experiment_end_to_end():
    cfg = dict(T.QUICK, widths=(32,), steps=4, eval_every=2, quick=True)
    res = T.experiment(cfg, torch.device("cpu"), log=lambda s: None)
    w = res["widths"]["32"]
    assert set(w["summary"]) == set(T.OPTIMIZERS)
    for name, runs in w["runs"].items():
        assert [r["lr"] for r in runs] == sorted(cfg["lrs"][name])
        for r in runs:
            assert math.isfinite(r["val"]) and r["val"] < math.log(256) + 0.5, (name, r)
            assert [t for t, _ in r["curve"]] == [2 * 4 * 32, 4 * 4 * 32]
    s = w["summary"]
    assert s["adamw"]["state_mib"] > s["sinkgd"]["state_mib"]  # AdamW's moments on the matrices
    report = T.new_report(torch.device("cpu"))
    report.extra["train"] = res
    md = T.markdown(report)
    assert "| 32 | sinkgd |" in md and "Quick run" in md


def test_resume_reuses_matching_runs_and_refuses_other_settings(monkeypatch):
    """--resume trains only the sweep points the earlier result lacks (at the same AdamW lr), and
    refuses a result made with other settings."""
    seen = []

    def fake(name, width, lr, adamw_lr, train, val, cfg, device, seed=0):
        seen.append((name, lr))
        return dict(val=abs(math.log2(lr / 8.0)), hidden_rms=1.0, opt_step_ms=0.0, lr=lr, adamw_lr=adamw_lr,
                    curve=[(1, 1.0)], state_bytes=0, params=1)

    monkeypatch.setattr(T, "train_one", fake)
    monkeypatch.setattr(T, "corpus", lambda mb: (None, None, dict(files=1, root="", train_bytes=0, val_bytes=0,
                                                                   val_files=0)))
    cfg = dict(T.QUICK, widths=(32,), lrs={"adamw": (4.0, 8.0, 16.0), "sinkgd": (2.0, 8.0, 32.0),
                                           "sinkgd_spectral": (8.0, 16.0, 32.0)}, quick=True)
    first = T.experiment(cfg, torch.device("cpu"), log=lambda s: None)
    assert len(seen) == 9
    assert {r["adamw_lr"] for r in first["widths"]["32"]["runs"]["sinkgd"]} == {8.0}  # AdamW's best lr
    scaled = T.experiment(dict(cfg, fallback_lr_scale=2.0), torch.device("cpu"), log=lambda s: None)
    assert {r["adamw_lr"] for r in scaled["widths"]["32"]["runs"]["sinkgd"]} == {16.0}
    seen.clear()
    cfg["lrs"] = dict(cfg["lrs"], sinkgd=(1.0, 2.0, 8.0))
    again = T.experiment(cfg, torch.device("cpu"), log=lambda s: None, resume=first)
    assert seen == [("sinkgd", 1.0)]
    assert [r["lr"] for r in again["widths"]["32"]["runs"]["sinkgd"]] == [1.0, 2.0, 8.0, 32.0]
    with pytest.raises(SystemExit, match="steps"):
        T.experiment(dict(cfg, steps=cfg["steps"] + 1), torch.device("cpu"), log=lambda s: None, resume=first)


class _SeedStandIn(torch.optim.Optimizer):
    """Stands in for axolotl's SinkGD in the harness test: its constructor's arguments, and the
    step our reference takes for the same settings (so the curves must agree)."""

    def __init__(self, params, lr, weight_decay, sinkhorn_iters, sinkgd_lr_scale, sinkgd_spectral_norm,
                 sinkgd_spectral_target, sinkgd_spectral_norm_iters):
        super().__init__(params, dict(lr=lr))
        self.kw = dict(sinkhorn_iters=sinkhorn_iters, lr_scale=sinkgd_lr_scale, weight_decay=weight_decay,
                       spectral_norm=sinkgd_spectral_norm, spectral_target=sinkgd_spectral_target)

    @torch.no_grad()
    def step(self):
        from torch_fused.optim import SinkGD

        if not hasattr(self, "inner"):
            self.inner = SinkGD(self.param_groups[0]["params"], lr=1.0, **self.kw)
        self.inner.param_groups[0]["lr"] = self.param_groups[0]["lr"]
        self.inner.step()


def test_seed_compare_harness_reports_the_difference_and_the_seed_spread():
    from torch_fused.bench import seed_compare as S

    cfg = dict(S.CONFIG, width=32, depth=1, seq=16, batch=4, steps=6, warmup=2, eval_every=3, eval_batches=2,
               data_mb=0.25)
    res = S.compare(cfg, torch.device("cpu"), seeds=2, eager=False, log=lambda s: None, cls=_SeedStandIn)
    for name, s in res["settings"].items():
        assert set(s["runs"]) == {"torch_fused seed 0", "torch_fused seed 1", "axolotl seed 0"}
        assert s["max_abs_diff"] < 1e-3, name  # the same algorithm: the same curve
        assert s["seed_spread"] > 0
    assert "| plain |" in S.markdown(res) and "| spectral |" in S.markdown(res)


def test_seed_compare_matches_axolotl_if_installed():
    """With axolotl's optimizer installed (pip install --no-deps axolotl torchao), plain SinkGD
    trains to the same curve as ours at a few steps."""
    pytest.importorskip("torchao")
    pytest.importorskip("axolotl")
    from torch_fused.bench import seed_compare as S

    cfg = dict(S.CONFIG, width=32, depth=1, seq=16, batch=4, steps=6, warmup=2, eval_every=3, eval_batches=2,
               data_mb=0.25)
    res = S.compare(cfg, torch.device("cpu"), seeds=1, eager=True, log=lambda s: None)
    assert res["settings"]["plain"]["max_abs_diff"] < 1e-3


def test_base_width_variant_and_cli_settings(tmp_path):
    """--optimizers adds the opt-in base_width variant (its groups carry the smallest width as
    base_width); --set overrides a setting; bad values are refused naming the option."""
    model = T.LM(32, 1, 8)
    opt = T.make_optimizer("sinkgd_base_width", model, 0.1, 1e-3, base_width=32)
    assert opt.param_groups[0]["base_width"] == 32
    rep = T.main(["--quick", "--device", "cpu", "--optimizers", "adamw,sinkgd_base_width", "--set", "depth=1",
                  "--out", str(tmp_path)])
    res = rep.extra["train"]
    assert res["config"]["depth"] == 1
    assert set(res["widths"]["32"]["runs"]) == {"adamw", "sinkgd_base_width"}
    for bad in (["--optimizers", "sinkgd"], ["--optimizers", "adamw,nope"], ["--set", "lr=3"]):
        with pytest.raises(SystemExit, match="--optimizers|--set"):
            T.main(["--quick", "--device", "cpu", "--out", str(tmp_path)] + bad)


def test_adamw_split_control_gives_the_sinkgd_runs_split():
    """adamw_split: AdamW on every parameter, the hidden matrices at the swept lr with weight
    decay, the embedding, head and vectors at the AdamW part's lr without: the same split and lrs
    as the SinkGD runs, so that a gain from the split is not credited to SinkGD."""
    model = T.LM(32, 1, 8)
    opt = T.make_optimizer("adamw_split", model, 0.1, 1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert len(by_param) == sum(1 for _ in model.parameters())
    hidden = {id(p) for g in T.make_optimizer("sinkgd", model, 0.1, 1e-3).param_groups
              if not g.get("use_fallback") for p in g["params"]}
    assert hidden
    for p in model.parameters():
        g = by_param[id(p)]
        want = (0.1, 0.1) if id(p) in hidden else (1e-3, 0.0)
        assert (g["lr"], g["weight_decay"]) == want
    assert id(model.lm_head.weight) not in hidden
