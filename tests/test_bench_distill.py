"""The distillation benchmarks (torch_fused/bench/distill.py, distill_step.py) at tiny sizes on CPU:
every row runs, the implementations agree with the float64 reference and with each other, the
result files are written, and the targets' verdicts follow the numbers. Skipped under
TRITON_INTERPRET=1 (the distillation ops' own tests run their kernels there)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torch_fused._library import INTERPRET

if INTERPRET:
    pytest.skip("benchmark smoke test: the plain CPU run covers it", allow_module_level=True)

from torch_fused.bench import common  # noqa: E402
from torch_fused.bench import distill as D  # noqa: E402
from torch_fused.bench import distill_step as DS  # noqa: E402

try:
    import trl.kernels.chunked_divergence  # noqa: F401

    HAS_TRL = True
except Exception:  # noqa: BLE001
    HAS_TRL = False


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _report(name, res):
    report = common.new_report()
    report.extra[name] = res
    return report


@pytest.fixture(scope="module")
def suite():
    """The suite at a tiny shape, beta 0.3 (a beta whose roles the formulas cannot swap unseen)."""
    torch.set_num_threads(1)
    return D.measure("cpu", shapes=[(32, 200)], student_h=16, teacher_h=(24,), topk=(1, 4), err_rows=8, reps=1,
                     beta=0.3,
                     log=lambda s: None)


def test_the_suite_runs_every_row_at_tiny_shapes(suite, tmp_path):
    rows = {r["impl"]: r for r in suite["rows"]}
    want = {D.OURS_REDUCED, D.OURS_REDUCED_ENT, D.OURS_PER_TOKEN, D.MATERIALIZED,
            "torch_fused top-k k=1 (tail bucket)", "torch_fused top-k k=4 (tail bucket)"}
    want |= {D.TRL} if HAS_TRL else set()
    assert want <= set(rows), sorted(rows)
    assert all("ms" in rows[i] and "error" not in rows[i] for i in want), [rows[i] for i in want]
    # Liger runs where it is installed (and a CUDA device is there); otherwise its row says why
    assert D.LIGER in rows or "pip install liger-kernel" in suite["skipped"][D.LIGER]
    for name in want:
        r = rows[name]
        assert r["floor"] == ("three student GEMMs" if "top-k" in name else "four GEMMs")
        assert r["shape"] == "N32 V200 Hs16 Ht24" and r["logits_fp32_mib"] == 32 * 200 * 4 / 2**20
        assert r["ms"] > 0 and r["floor_ms"] > 0 and math.isclose(r["x_floor"], r["ms"] / r["floor_ms"])
    # report files: JSON (loadable), the markdown table with every row and the targets
    report = _report("distill", suite)
    D.save(report, tmp_path, "distill")
    data = json.loads((tmp_path / "distill.json").read_text())
    assert len(data["extra"]["distill"]["rows"]) == len(suite["rows"])
    md = (tmp_path / "distill.md").read_text()
    assert all(f"| {name} |" in md for name in want) and "| target | verdict | measured |" in md


def test_the_implementations_agree_with_float64(suite):
    """Every implementation computes the divergence the float64 reference does (bf16 inputs): ours
    to the targets' accuracy (the CPU path keeps d logits in fp32), TRL's to fp32 rounding (its
    gradients from d logits rounded to bf16: a few roundings), the materialized formula to its bf16
    logits' rounding; so a wrong formula in the suite (the reference's, or an implementation's
    call) shows here."""
    tols = {"ours": (1e-5, D.BAR_DIVERGENCE_NATS, D.BAR_GRAD_ROUNDINGS), D.TRL: (1e-5, 1e-5, 3.0),
            D.MATERIALIZED: (2e-3, 2e-2, 10.0)}
    for r in suite["rows"]:
        loss_tol, div_tol, grad_tol = tols["ours" if r["impl"].startswith("torch_fused") else r["impl"]]
        assert r["loss_err_nats"] <= loss_tol, r
        if r["divergence_err_nats"] is not None:
            assert r["divergence_err_nats"] <= div_tol, r
        assert r["d_hidden_roundings"] <= grad_tol and r["d_weight_roundings"] <= grad_tol, r
    per = next(r for r in suite["rows"] if r["impl"] == D.OURS_PER_TOKEN)
    assert per["divergence_err_nats"] is not None  # the per-token rows are checked per token


def test_divergence_formulas():
    """The suite's formulas against direct definitions in float64: TRL's generalized JSD form at
    beta 0, 1 and between; the tail bucket's k + 1 categories."""
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(5, 13, generator=g, dtype=torch.float64) * 2
    zt = torch.randn(5, 13, generator=g, dtype=torch.float64)
    ps, pt = zs.softmax(-1), zt.softmax(-1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    torch.testing.assert_close(D.divergence_materialized(zs, zt, 0.0), kl(pt, ps))
    torch.testing.assert_close(D.divergence_materialized(zs, zt, 1.0), kl(ps, pt))
    m = 0.7 * ps + 0.3 * pt
    torch.testing.assert_close(D.divergence_materialized(zs, zt, 0.3), 0.3 * kl(pt, m) + 0.7 * kl(ps, m))
    ids = pt.topk(3, -1).indices
    s3, t3 = ps.gather(-1, ids), pt.gather(-1, ids)
    s4 = torch.cat([s3, 1 - s3.sum(-1, keepdim=True)], -1)
    t4 = torch.cat([t3, 1 - t3.sum(-1, keepdim=True)], -1)
    torch.testing.assert_close(D.divergence_topk(zs, ids, t3.log(), 0.0), kl(t4, s4))


def test_a_failing_implementation_is_a_row_not_a_crash(monkeypatch):
    full = D.full_impls

    def broken(hs, ws, ht, wt):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(D, "full_impls", lambda beta, t: {D.OURS_REDUCED: full(beta, t)[D.OURS_REDUCED],
                                                          "broken": broken, "absent": "not run: no such library"})
    res = D.measure("cpu", shapes=[(8, 50)], student_h=8, teacher_h=(8,), topk=(), err_rows=4, reps=1,
                    log=lambda s: None)
    rows = {r["impl"]: r for r in res["rows"]}
    assert rows["broken"]["error"] == "RuntimeError: kernel exploded" and "ms" in rows[D.OURS_REDUCED]
    assert res["skipped"] == {"absent": "not run: no such library"}
    md = D.markdown(_report("distill", res))
    assert "RuntimeError: kernel exploded" in md and "not run: no such library" in md


def _row(impl, ms, floor_ms, peak=None, floor="four GEMMs", **kw):
    r = dict(group="g", shape="S", impl=impl, floor=floor, ms=ms, floor_ms=floor_ms, x_floor=ms / floor_ms,
             peak_extra_mib=peak, logits_fp32_mib=800.0, dweight_fp32_mib=50.0, divergence_err_nats=None,
             loss_err_nats=0.0, d_hidden_roundings=1.0, d_weight_roundings=1.0)
    r.update(kw)
    return r


def test_bar_verdicts_follow_the_numbers():
    res = dict(skipped={D.LIGER: "not run: liger_kernel not importable"}, rows=[
        _row(D.OURS_REDUCED, 12.9, 10.0, peak=149.0),  # 1.29x; budget 800/8 + 50 = 150 MiB
        _row(D.OURS_PER_TOKEN, 16.6, 10.0, peak=101.0, divergence_err_nats=2e-5, d_weight_roundings=1.3),
        _row(D.TRL, 15.0, 10.0),
        _row("torch_fused top-k k=20 (tail bucket)", 14.1, 10.0, floor="three student GEMMs")])
    b = {k.split(": ", 1)[1]: v["verdict"] for k, v in D.bars(res).items()}
    assert b[f"{D.OURS_REDUCED} <= 1.3x the four bare GEMMs"] == "PASS"
    assert b[f"{D.OURS_PER_TOKEN} <= 1.65x the four bare GEMMs"] == "FAIL"
    assert b[f"{D.OURS_REDUCED} faster than {D.TRL}"] == "PASS"
    assert b[f"{D.OURS_PER_TOKEN} faster than {D.TRL}"] == "FAIL"
    assert b[f"{D.OURS_REDUCED} faster than {D.LIGER}"] == "n/a"
    assert b[f"{D.OURS_REDUCED} peak extra <= 1/8 of the [N, V] fp32 logits + the fp32 [V, Hs] d weight"] == "PASS"
    assert b[f"{D.OURS_PER_TOKEN} peak extra <= 1/8 of the [N, V] fp32 logits"] == "FAIL"
    assert b[f"{D.OURS_PER_TOKEN} divergence within 1e-05 nats of float64"] == "FAIL"
    assert b[f"{D.OURS_REDUCED} gradients within 1.25x one bf16 rounding of float64"] == "PASS"
    assert b[f"{D.OURS_PER_TOKEN} gradients within 1.25x one bf16 rounding of float64"] == "FAIL"
    assert b["torch_fused top-k k=20 (tail bucket) <= 1.4x the student head's three bare GEMMs"] == "FAIL"


# ------------------------------------------------------------------------------------------------
# the distillation training step


def test_the_step_suite_runs_and_its_paths_agree(tmp_path):
    cfg = DS.tiny()
    res = DS.measure(cfg, "cpu", reps=1, warmup=1, max_batch=False, log=lambda s: None)
    paths = ["materialized", "torch_fused"] + (["trl"] if HAS_TRL else [])
    assert not res["errors"], res["errors"]
    assert sorted(res["equal_batch"]) == sorted(paths)
    for p in paths:
        r = res["equal_batch"][p]
        assert math.isfinite(r["loss"]) and r["ms"] > 0 and r["peak_mib"] is None  # no memory figures on CPU
        assert r["tokens_per_s"] == pytest.approx(cfg.student.batch * cfg.student.seq / (r["ms"] * 1e-3))
    # the same loss and d lm_head from the same weights (fp32: to rounding); peaked distributions
    agree = res["agreement"]
    assert agree["materialized"]["loss"] > 0.1
    for p in paths[1:]:
        assert agree[p]["loss_rel_diff"] < 1e-5 and agree[p]["d_lm_head_rel_diff"] < 1e-4, agree
    # the student trained: each path's loss fell over its steps on the same batch
    assert all(res["equal_batch"][p]["loss"] < res["equal_batch"][p]["first_loss"] for p in paths)
    DS.save(_report("distill_step", res), tmp_path, "distill_step")
    md = (tmp_path / "distill_step.md").read_text()
    assert all(f"| {p} |" in md for p in paths)
    assert json.loads((tmp_path / "distill_step.json").read_text())["extra"]["distill_step"]["config"]["beta"] == 0.5


def test_the_step_presets():
    full = DS.full()
    full.check()
    s, t = full.student, full.teacher
    n_s = s.layers * (s.hidden * (s.heads + 2 * s.kv_heads) * (s.hidden // s.heads) + s.hidden ** 2
                      + 3 * s.hidden * s.intermediate + 2 * s.hidden) + 2 * s.vocab * s.hidden + s.hidden
    n_t = t.layers * (t.hidden * (t.heads + 2 * t.kv_heads) * (t.hidden // t.heads) + t.hidden ** 2
                      + 3 * t.hidden * t.intermediate + 2 * t.hidden) + 2 * t.vocab * t.hidden + t.hidden
    assert 1.2e9 < n_s < 1.6e9 and 3.2e9 < n_t < 3.7e9  # a ~1B student, a ~3B-shaped teacher (untied heads)
    assert s.seq == t.seq == 4096 and s.vocab == t.vocab
    with pytest.raises(ValueError, match="teacher.vocab"):
        DS.DistillConfig(teacher=DS._teacher_3b().__class__(**{**DS._teacher_3b().__dict__, "vocab": 1000})).check()
    with pytest.raises(ValueError, match="beta"):
        DS.DistillConfig(beta=1.5).check()
