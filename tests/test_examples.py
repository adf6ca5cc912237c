"""The scripts in examples/, run at tiny sizes on CPU.

Each example checks its own result and raises when it is wrong (the GRPO loop: finite losses and
a rising reward; the packed GRPO loop: also the padded layout's loss at every step; the fused
head: values and gradients equal to the materialized logits'; the distillation loop: the first
step's loss and gradients equal to the materialized formula's and a falling divergence; the TRL
example: a finite loss at every step); these tests call each script's main() with tiny sizes,
assert on what it returns, and show that its check raises on a wrong result. One test runs a
script as a program (python examples/x.py), another the 2-rank example under torchrun.

Ops on tiny tensors run one thread here: with more threads than free cores, OpenMP's waiting
makes them up to ten times slower (seen on a two-core CI machine under load). Under TRITON_INTERPRET=1 only the fused-head example runs
(through the interpreted kernels), in process; the rest is covered by the plain run.
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_fused._library import INTERPRET

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SLOW_UNDER_INTERPRETER = pytest.mark.skipif(
    INTERPRET, reason="the plain CPU run covers this example; the interpreter run covers its kernels in the op tests")


def load(name):
    spec = importlib.util.spec_from_file_location(f"torch_fused_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


# --- examples/grpo_step.py: the plain-PyTorch GRPO loop --------------------------------------

GRPO_TINY = ["--device", "cpu", "--steps", "16", "--vocab", "64", "--hidden", "32", "--prompt-len", "4",
             "--completion-len", "8", "--lr", "0.1", "--adamw-lr", "1e-2"]


@SLOW_UNDER_INTERPRETER
def test_grpo_step_example_learns():
    hist = load("grpo_step").main(GRPO_TINY)
    assert len(hist["loss"]) == 16 and all(math.isfinite(x) for x in hist["loss"] + hist["entropy"])
    first, last = sum(hist["reward"][:4]) / 4, sum(hist["reward"][-4:]) / 4
    assert last > first + 0.2, hist["reward"]  # about 0.28 -> 0.85 as measured
    assert hist["entropy"][-1] < hist["entropy"][0]  # the policy sharpens on the rewarded tokens


def test_grpo_step_example_check_raises():
    check = load("grpo_step").check
    check(dict(loss=[0.1, 0.2], reward=[0.2, 0.5]))
    with pytest.raises(RuntimeError, match="did not rise"):
        check(dict(loss=[0.1, 0.2, 0.1, 0.3], reward=[0.5, 0.4, 0.3, 0.2]))
    with pytest.raises(RuntimeError, match="non-finite loss at steps \\[1\\]"):
        check(dict(loss=[0.1, float("nan")], reward=[0.2, 0.5]))


def test_grpo_step_example_rejects_bad_arguments(capsys):
    mod = load("grpo_step")
    with pytest.raises(SystemExit):
        mod.parse_args(["--group-size", "1"])
    assert "--group-size: expected >= 2" in capsys.readouterr().err


# --- examples/packed_grpo.py: GRPO on packed batches ------------------------------------------

@SLOW_UNDER_INTERPRETER
def test_packed_grpo_example_learns_and_agrees_with_padded():
    mod = load("packed_grpo")
    hist = mod.main(["--device", "cpu", "--steps", "16", "--mode", "seq-mean-token-sum-norm"])
    assert len(hist["loss"]) == 16 and all(math.isfinite(x) for x in hist["loss"] + hist["entropy"])
    assert max(hist["gap"]) <= mod.AGREE_TOL  # the packed loss is the padded layout's at every step
    assert sum(hist["tokens"]) < sum(hist["padded_tokens"])  # packing stored fewer tokens than padding
    first, last = sum(hist["reward"][:4]) / 4, sum(hist["reward"][-4:]) / 4
    assert last > first + 0.2, hist["reward"]  # about 0.29 -> 0.64 as measured


def test_packed_grpo_example_check_raises():
    check = load("packed_grpo").check
    ok = dict(loss=[0.1, 0.2], reward=[0.2, 0.5], gap=[0.0, 1e-6], tokens=[5, 6], padded_tokens=[8, 8])
    check(ok)
    with pytest.raises(RuntimeError, match="differs from the padded layout's at steps \\[1\\]"):
        check(dict(ok, gap=[0.0, 1e-2]))
    with pytest.raises(RuntimeError, match="did not rise"):
        check(dict(ok, reward=[0.5, 0.2]))
    with pytest.raises(RuntimeError, match="non-finite loss at steps \\[0\\]"):
        check(dict(ok, loss=[float("inf"), 0.2]))


# --- examples/fused_head.py: the fused head against materialized logits ----------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_head_example_matches(dtype):
    mod = load("fused_head")
    size = ["--tokens", "6", "--vocab", "37", "--hidden", "8"] if INTERPRET else \
        ["--tokens", "40", "--vocab", "300", "--hidden", "32"]
    errs = mod.main(["--device", "cpu", "--dtype", dtype, "--temperature", "0.8"] + size)
    assert set(errs) == {"logp", "ent", "d_hidden", "d_weight"}
    assert all(e <= mod.TOL[dtype] for e in errs.values()), errs


def test_fused_head_example_check_raises():
    mod = load("fused_head")
    ref = torch.randn(4, 8)
    assert mod.check_close("logp", ref.clone(), ref, 1e-6) == 0
    with pytest.raises(AssertionError, match="d_weight: fused and materialized differ"):
        mod.check_close("d_weight", ref * 1.01, ref, 1e-3)
    with pytest.raises(AssertionError, match="ent: fused and materialized differ"):
        mod.check_close("ent", torch.full_like(ref, float("nan")), ref, 1e-3)
    with pytest.raises(AssertionError, match="shapes differ"):
        mod.check_close("logp", ref[:2], ref, 1e-3)


@SLOW_UNDER_INTERPRETER
def test_fused_head_example_runs_as_a_script():
    out = subprocess.run([sys.executable, str(EXAMPLES / "fused_head.py"), "--device", "cpu", "--tokens", "8",
                          "--vocab", "50", "--hidden", "8"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fused vs materialized relative errors" in out.stdout


# --- examples/distill.py: a student distilled from a frozen teacher ---------------------------

DISTILL_TINY = ["--device", "cpu", "--steps", "12", "--batch", "4", "--seq", "12", "--prompt", "3", "--vocab", "64",
                "--student-hidden", "16", "--teacher-hidden", "24", "--lr", "1e-2"]


@SLOW_UNDER_INTERPRETER
@pytest.mark.parametrize("extra", [[], ["--teacher", "topk", "--k", "4"], ["--beta", "0", "--temperature", "2"],
                                   ["--beta", "1", "--dtype", "bfloat16"]], ids=["jsd", "topk", "forward_kl", "reverse_kl_bf16"])
def test_distill_example_learns_and_matches(extra):
    mod = load("distill")
    hist = mod.main(DISTILL_TINY + extra)
    assert len(hist["loss"]) == 12 and all(math.isfinite(x) for x in hist["loss"])
    tol = mod.TOL["bfloat16" if "bfloat16" in extra else "float32"]
    assert set(hist["check"]) == {"loss", "d_hidden", "d_weight"} and max(hist["check"].values()) <= tol, hist["check"]
    assert sum(hist["loss"][-3:]) < sum(hist["loss"][:3])  # the student moved toward the teacher


def test_distill_example_check_raises():
    check = load("distill").check
    ok = dict(loss=[0.5, 0.4, 0.3, 0.2], check=dict(loss=0.0, d_hidden=1e-6, d_weight=1e-6))
    check(ok, 1e-4)
    with pytest.raises(RuntimeError, match="non-finite loss at steps \\[2\\]"):
        check(dict(ok, loss=[0.5, 0.4, float("nan"), 0.2]), 1e-4)
    with pytest.raises(RuntimeError, match="fused and materialized differ.*d_weight"):
        check(dict(ok, check=dict(ok["check"], d_weight=float("nan"))), 1e-4)
    with pytest.raises(RuntimeError, match="did not fall"):
        check(dict(ok, loss=[0.2, 0.3, 0.4, 0.5]), 1e-4)


def test_distill_example_rejects_bad_arguments(capsys):
    mod = load("distill")
    for argv, msg in ((["--beta", "1.5"], "--beta: expected a value in [0, 1]"),
                      (["--prompt", "40", "--seq", "32"], "--prompt: expected 0 <= prompt < seq - 1"),
                      (["--teacher", "topk", "--k", "600"], "--k: expected at most --vocab")):
        with pytest.raises(SystemExit):
            mod.parse_args(argv)
        assert msg in capsys.readouterr().err


# --- examples/vocab_parallel.py: 2 ranks under torchrun (gloo) -------------------------------

@SLOW_UNDER_INTERPRETER
def test_vocab_parallel_example_under_torchrun():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--standalone", str(EXAMPLES / "vocab_parallel.py")],
                         cwd=ROOT, env=dict(_env(), CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "equal to the single-device ops" in out.stdout


# --- examples/grpo_trl.py: TRL's GRPOTrainer, patched --------------------------------------

_TRL_HOW = "the TRL example needs the trl extra: pip install -e '.[trl]'"


@SLOW_UNDER_INTERPRETER
def test_grpo_trl_example(tmp_path, monkeypatch, capsys):
    for name in ("trl", "transformers", "datasets", "accelerate"):
        pytest.importorskip(name, reason=_TRL_HOW)
    import torch_fused
    from torch_fused.integrations import trl as tf_trl

    import trl

    if trl.__version__ not in tf_trl.TESTED_TRL_VERSIONS:
        pytest.skip(f"TRL {trl.__version__} is not a tested version: {_TRL_HOW}")
    calls = []
    for name in ("selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy",
                 "linear_logprobs_and_entropy"):
        fn = getattr(torch_fused, name)
        monkeypatch.setattr(torch_fused, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # without --output-dir: a new folder under it
    res = load("grpo_trl").main(["--tiny", "--cpu", "--max-steps", "2", "--batch-size", "4",
                                 "--num-generations", "2", "--max-completion-length", "8"])
    out = [p for p in tmp_path.iterdir() if p.name.startswith("grpo_trl_")]
    assert len(out) == 1 and f"output directory: {out[0]}" in capsys.readouterr().out
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])
    assert res["patched"] and calls, "patch() routed nothing to torch_fused"
    assert tf_trl.patched_names() == []  # the context manager restored TRL
