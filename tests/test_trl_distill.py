"""The TRL integration's distillation route against the installed TRL, on CPU.

Client tests: TRL's ``DistillationTrainer`` (on-policy: the student generates, a wider teacher
scores) and ``GKDTrainer`` train a tiny Qwen2 for two steps, with TRL's own path and with
``patch()``: the logged losses, entropies and gradient norms and the parameter updates agree.
Then each adapter beside TRL's original function (``_chunked_divergence_loss``,
``ChunkedDivergenceFunction``, ``GKDTrainer.generalized_jsd_loss``): values, gradients, masks,
the reductions, the calls TRL keeps, and patch()'s options and summary.

Needs the optional `trl` extra (pip install -e '.[trl]'); skipped without it, on a TRL without
the forms this route adapts, and in the TRITON_INTERPRET=1 run (the trainers take too long under
the interpreter; the distillation ops' own tests cover their kernels there).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings

import pytest
import torch

from torch_fused._library import INTERPRET

if INTERPRET:
    pytest.skip("TRL client test: the plain CPU run covers it (too slow under TRITON_INTERPRET=1)",
                allow_module_level=True)

_HOW = "the TRL integration test needs the trl extra: pip install -e '.[trl]'"
trl = pytest.importorskip("trl", reason=_HOW)
for _name in ("transformers", "datasets", "accelerate"):
    pytest.importorskip(_name, reason=_HOW)

import torch_fused  # noqa: E402
from torch_fused.integrations import trl as tf_trl  # noqa: E402

VERSION = trl.__version__
if VERSION not in tf_trl.DISTILL_TRL_VERSIONS:
    pytest.skip(f"TRL {VERSION} has no form the distillation route adapts ({', '.join(tf_trl.DISTILL_TRL_VERSIONS)})",
                allow_module_level=True)

try:
    import trl.trainer.distillation_trainer as dist_mod  # noqa: E402
except ImportError as e:  # TRL 1.13's imports requests, which its requirements do not name
    pytest.skip(f"TRL {VERSION}'s DistillationTrainer does not import here: {e}", allow_module_level=True)

# TRL 1.16: the trainer's loss runs trl.kernels.chunked_divergence.ChunkedDivergenceFunction; 1.13 and
# 1.14: a checkpointed chunk loop over materialized chunks, with a chunk_size argument
try:
    cd_mod = importlib.import_module("trl.kernels.chunked_divergence")
except ImportError:
    cd_mod = None

with warnings.catch_warnings():  # TRL's notice on importing trl.experimental
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import gkd_trainer as gkd_mod  # noqa: E402

LOSS = dist_mod._chunked_divergence_loss
FUNCTION = getattr(cd_mod, "ChunkedDivergenceFunction", None)
CHUNK_SIZE = "chunk_size" in inspect.signature(LOSS).parameters  # TRL 1.13 / 1.14
GKD_LOSS = gkd_mod.GKDTrainer.__dict__["generalized_jsd_loss"]


@pytest.fixture(autouse=True)
def _unpatched():
    tf_trl.unpatch()
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads than free cores only wait
    yield
    tf_trl.unpatch()
    torch.set_num_threads(n)


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments of each call into torch_fused.linear_distill / distill."""
    seen = {"linear_distill": [], "distill": []}
    for name in seen:
        fn = getattr(torch_fused, name)

        def counted(*a, _fn=fn, _name=name, **k):
            seen[_name].append(k)
            return _fn(*a, **k)

        monkeypatch.setattr(torch_fused, name, counted)
    return seen


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# the clients: DistillationTrainer and GKDTrainer, two steps each


def _tokenizer(chat=False):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(253)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  padding_side="left")
    if chat:  # GKD's collator renders conversations
        out.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                             "{% if add_generation_prompt %}w0 {% endif %}")
    return out


def _model(hidden, seed):
    """A tiny random Qwen2 whose lm_head is scaled up, so that its next-token distributions are
    peaked and the divergence and its gradients are far from zero."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


_COMMON = dict(max_steps=2, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd",
               lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
               seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False, gradient_checkpointing=False)


def _distillation_run(tmp_path, patch):
    """Two on-policy DistillationTrainer steps: a 32-wide student, a 48-wide teacher (another
    hidden size, the same vocabulary), beta 0.5, temperature 0.7. The end-of-sequence token is
    made likely while sampling, so that completions end early and the completion mask drops
    positions. (per-step logs, student parameters before, after)."""
    from datasets import Dataset

    from trl import DistillationConfig, DistillationTrainer

    student, teacher = _model(32, 0), _model(48, 1)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    prompts = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10 w11"]})
    args = DistillationConfig(output_dir=str(tmp_path), max_completion_length=8, temperature=0.7, beta=0.5,
                              generation_kwargs={"sequence_bias": [[[1], 3.0]]}, **_COMMON)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=prompts,
                                  processing_class=_tokenizer())
    with tf_trl.patched() if patch else _nothing():
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, before, {n: p.detach().clone() for n, p in student.named_parameters()}


def _gkd_run(tmp_path, patch):
    """Two GKDTrainer steps on fixed conversations (lmbda 0: the dataset's completions), beta 0.5."""
    from datasets import Dataset

    from trl.experimental.gkd import GKDConfig, GKDTrainer

    student, teacher = _model(32, 0), _model(48, 1)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    pairs = [("w1 w2 w3", "w5 w6 w7 w8"), ("w4", "w9 w10"), ("w11 w12", "w13 w14 w15 w16 w17"), ("w18 w19 w20", "w22")]
    data = Dataset.from_dict({"messages": [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                                           for p, c in pairs]})
    args = GKDConfig(output_dir=str(tmp_path), max_length=24, lmbda=0.0, beta=0.5, **_COMMON)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data,
                         processing_class=_tokenizer(chat=True))
    with tf_trl.patched() if patch else _nothing():
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, before, {n: p.detach().clone() for n, p in student.named_parameters()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _assert_same_training(run, ref, keys):
    logs, before, after = run
    ref_logs, ref_before, ref_after = ref
    assert len(logs) == len(ref_logs) == 2
    for n in ref_before:
        assert torch.equal(before[n], ref_before[n]), f"{n}: the runs started from different weights"
    for step, (a, b) in enumerate(zip(logs, ref_logs)):
        for key in keys:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), \
                f"step {step + 1} {key}: {a[key]} vs TRL's {b[key]}"
    assert all(h["grad_norm"] > 1e-2 for h in ref_logs), "the steps did not train (no gradient)"
    # parameter updates (SGD: lr x the summed gradients), relative to TRL's, less one rounding of
    # the updated fp32 parameter (a norm weight near 1 moved by 1e-5 keeps 2-3 digits of its update)
    for n in ref_before:
        d, ref_d = after[n] - before[n], ref_after[n] - ref_before[n]
        ulp = torch.finfo(torch.float32).eps * ref_after[n].abs()
        err = ((d - ref_d).abs() - ulp).clamp_min(0).norm() / ref_d.norm()
        assert err < 2e-4, f"{n}: update differs from TRL's by {err:.2e} (relative)"


def test_distillation_trainer_patched_equals_trl(tmp_path, calls, capsys):
    ref = _distillation_run(tmp_path / "trl", patch=False)
    assert not calls["linear_distill"]
    run = _distillation_run(tmp_path / "ours", patch=True)
    line = [s for s in capsys.readouterr().err.splitlines() if s.startswith("torch_fused.integrations.trl")][-1]
    assert "trl.trainer.distillation_trainer._chunked_divergence_loss" in line, line
    # the trainer's loss takes a reduced mode (the sum over the batch's token count), once per step
    assert [k["reduction"] for k in calls["linear_distill"]] == ["sum"] * 2, calls
    # a completion ended early: the completion mask dropped positions from the loss
    assert min(h["completions/min_length"] for h in ref[0]) < 8
    _assert_same_training(run, ref, ("loss", "entropy", "grad_norm"))


def test_gkd_trainer_patched_equals_trl(tmp_path, calls):
    ref = _gkd_run(tmp_path / "trl", patch=False)
    run = _gkd_run(tmp_path / "ours", patch=True)
    assert len(calls["distill"]) == 2 and all(k["reduction"] == "sum" for k in calls["distill"]), calls
    _assert_same_training(run, ref, ("loss", "grad_norm"))


# ------------------------------------------------------------------------------------------------
# each adapter beside TRL's function


def _adapters(**options):
    """The replacements patch() installs, taken out again (the tests call them beside TRL's
    originals while unpatched)."""
    tf_trl.patch(verbose=False, **options)
    found = {"loss": dist_mod._chunked_divergence_loss, "function": getattr(cd_mod, "ChunkedDivergenceFunction", None),
             "gkd": gkd_mod.GKDTrainer.__dict__["generalized_jsd_loss"].__func__}
    tf_trl.unpatch()
    assert dist_mod._chunked_divergence_loss is LOSS and getattr(cd_mod, "ChunkedDivergenceFunction", None) is FUNCTION
    assert gkd_mod.GKDTrainer.__dict__["generalized_jsd_loss"] is GKD_LOSS
    assert found["loss"] is not LOSS and found["gkd"] is not GKD_LOSS.__func__
    assert FUNCTION is None or found["function"] is not FUNCTION
    return found


def _loss_args(*args):
    """TRL's _chunked_divergence_loss positional arguments up to beta, and 1.13 / 1.14's chunk_size
    (4 rows: several chunks)."""
    return args + ((4,) if CHUNK_SIZE else ())


def _heads(seed=0, b=3, k=5, hs=16, ht=24, v=67, bias=False):
    """Student and teacher hidden states [B, K, H] and heads; the teacher's parameters require a
    gradient (as a model's parameters do) that the divergence must not give them."""
    g = torch.Generator().manual_seed(seed)
    hid_s = torch.randn(b, k, hs, generator=g).requires_grad_()
    hid_t = torch.randn(b, k, ht, generator=g)
    w_s = (torch.randn(v, hs, generator=g) * 0.6).requires_grad_()
    w_t = (torch.randn(v, ht, generator=g) * 0.6).requires_grad_()
    b_s = (torch.randn(v, generator=g) * 0.5).requires_grad_() if bias else None
    b_t = (torch.randn(v, generator=g) * 0.5).requires_grad_() if bias else None
    mask = torch.ones(b, k, dtype=torch.int64)
    mask[0, 3:] = 0
    mask[2] = 0  # a sequence with nothing in the loss
    return hid_s, hid_t, w_s, w_t, b_s, b_t, mask


def _grads(out, inputs):
    return torch.autograd.grad(out, [x for x in inputs if x is not None])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("case", ["fp32", "bias_scale_softcap_temperature", "num_items", "bf16_autocast"])
def test_chunked_divergence_loss(beta, case, calls):
    ours_fn = _adapters()["loss"]
    hid_s, hid_t, w_s, w_t, b_s, b_t, mask = _heads(bias=case == "bias_scale_softcap_temperature")
    kw = dict(student_lm_head_bias=b_s, teacher_lm_head_bias=b_t)
    if case == "bias_scale_softcap_temperature":
        kw.update(student_logit_scale=0.8, teacher_logit_scale=1.3, student_final_logit_softcapping=6.0,
                  teacher_final_logit_softcapping=9.0, temperature=0.7)
    if case == "num_items":
        kw["num_items_in_batch"] = torch.tensor(23.0)  # the global count (gradient accumulation, DDP)
    args = _loss_args(hid_s, hid_t, w_s, w_t, mask, beta)
    inputs = (hid_s, w_s, b_s)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16_autocast"):
        ours, theirs = ours_fn(*args, **kw), LOSS(*args, **kw)
    reduction = "sum" if case == "num_items" else "token-mean"  # gradients formed in the forward pass
    assert len(calls["linear_distill"]) == 1 and calls["linear_distill"][0]["reduction"] == reduction
    assert ours[2].dtype == theirs[2].dtype and torch.equal(ours[2], theirs[2])  # the count of positions
    assert ours[0].dtype == theirs[0].dtype == torch.float32 and ours[0].shape == theirs[0].shape == ()
    assert theirs[0].item() > 0.05  # not a degenerate case
    # TRL 1.13 / 1.14 round each chunk's logits to the autocast dtype (bf16) before the softmax
    tol = 2e-2 if case == "bf16_autocast" and CHUNK_SIZE else 1e-5
    assert _rel(ours[0], theirs[0]) < tol and _rel(ours[1], theirs[1]) < tol, (ours, theirs)
    assert not ours[1].requires_grad or not theirs[1].requires_grad
    # gradients to the student's hidden states, weight and bias: fp32 on fp32 inputs; under bf16
    # autocast TRL rounds d logits to bf16 before its d hidden / d weight products, ours does not
    tol = 2e-2 if case == "bf16_autocast" else 1e-5
    mine = torch.autograd.grad(ours[0], [x for x in inputs if x is not None] + [w_t], allow_unused=True)
    for a, b in zip(mine, _grads(theirs[0], inputs)):
        assert _rel(a, b) < tol, _rel(a, b)
    # the teacher gets no gradient, and masked-out positions give none either
    assert mine[-1] is None and mine[0][2].abs().max() == 0


@pytest.mark.skipif(FUNCTION is None, reason=f"TRL {VERSION} has no ChunkedDivergenceFunction")
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_chunked_divergence_function(beta, calls):
    fn = _adapters()["function"]
    hid_s, hid_t, w_s, w_t, b_s, b_t, _ = _heads(bias=True)
    hid_s, hid_t = hid_s.detach().reshape(-1, 16).requires_grad_(), hid_t.reshape(-1, 24)
    args = (hid_s, w_s, b_s, hid_t, w_t, b_t, beta, 0.8, 1.1, 7.0, 0.9, None)
    ours, theirs = fn.apply(*args), FUNCTION.apply(*args)
    assert calls["linear_distill"] and calls["linear_distill"][0].get("reduction", "none") == "none"
    for o, t in zip(ours, theirs):
        assert o.dtype == t.dtype == torch.float32 and o.shape == t.shape == (15,)
        assert _rel(o, t) < 1e-5, _rel(o, t)
    assert not ours[1].requires_grad and ours[0].requires_grad
    w = torch.randn(15, generator=torch.Generator().manual_seed(1))
    for a, b in zip(_grads((ours[0] * w).sum(), (hid_s, w_s, b_s)), _grads((theirs[0] * w).sum(), (hid_s, w_s, b_s))):
        assert _rel(a, b) < 1e-5, _rel(a, b)


def _logits(seed=0, shape=(3, 5, 41), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_()
    t = (torch.randn(shape, generator=g) * 3).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    labels[0, 2:] = -100
    labels[1, 0] = -100
    return s, t, labels


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "num_items"])
@pytest.mark.parametrize("with_labels", [True, False])
def test_generalized_jsd_loss(beta, reduction, with_labels, calls):
    fn = _adapters()["gkd"]
    s, t, labels = _logits()
    kw = dict(labels=labels if with_labels else None, beta=beta, temperature=0.9)
    kw.update(num_items_in_batch=17) if reduction == "num_items" else kw.update(reduction=reduction)
    ours, theirs = fn(s, t, **kw), GKD_LOSS.__func__(s, t, **kw)
    assert len(calls["distill"]) == 1
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape == ()
    assert _rel(ours, theirs) < 1e-5, (ours, theirs)
    ga, gb = torch.autograd.grad(ours, s)[0], torch.autograd.grad(theirs, s)[0]
    assert _rel(ga, gb) < 1e-5, _rel(ga, gb)


def test_generalized_jsd_loss_dtype_and_empty_mask(calls):
    fn = _adapters()["gkd"]
    s, t, labels = _logits(dtype=torch.bfloat16)
    ours, theirs = fn(s, t, labels), GKD_LOSS.__func__(s, t, labels)
    assert ours.dtype == theirs.dtype == torch.bfloat16  # TRL computes in the logits' dtype
    assert abs(ours.float() - theirs.float()) <= 2e-2 * abs(theirs.float())
    none = torch.full_like(labels, -100)
    assert fn(s, t, none).item() == GKD_LOSS.__func__(s, t, none).item() == 0  # batchmean over max(count, 1)
    assert fn(s, t, none, reduction="mean").isnan() and GKD_LOSS.__func__(s, t, none, reduction="mean").isnan()


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # TRL's loss given a tensor beta
def test_calls_outside_the_route_go_to_trl(calls):
    """Calls whose semantics the fused ops do not share run TRL's function, unchanged."""
    found = _adapters()
    s, t, labels = _logits()
    t_grad = t.detach().clone().requires_grad_()
    for kw in (dict(reduction="none"), dict(labels=labels, reduction="none"), dict(beta=torch.tensor(0.5))):
        assert torch.equal(found["gkd"](s, t, **kw), GKD_LOSS.__func__(s, t, **kw))
    # a teacher that requires a gradient gets one from TRL's loss
    assert torch.equal(found["gkd"](s, t_grad, labels), GKD_LOSS.__func__(s, t_grad, labels))
    hid_s, hid_t, w_s, w_t, b_s, b_t, mask = _heads()
    zero3 = w_s.detach().clone().requires_grad_()
    zero3.ds_id = 7  # a DeepSpeed ZeRO-3 parameter: TRL gathers it around each use
    for args, kw in ((_loss_args(hid_s, hid_t, zero3, w_t, mask, 0.5), {}),
                     (_loss_args(hid_s, hid_t, w_s, w_t, mask, 0.5), dict(student_logit_scale=0.0)),
                     (_loss_args(hid_s, hid_t, w_s, w_t, mask, 0.5), dict(temperature=-1.0)),
                     (_loss_args(hid_s, hid_t, w_s, w_t, mask.float()[:, :4], 0.5), {})):
        try:
            expected = LOSS(*args, **kw)
        except Exception as e:  # noqa: BLE001 - the adapter must raise what TRL raises
            with pytest.raises(type(e)):
                found["loss"](*args, **kw)
        else:
            got = found["loss"](*args, **kw)
            assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(got, expected))
    if FUNCTION is not None:
        flat = (hid_s.reshape(-1, 16), zero3, None, hid_t.reshape(-1, 24), w_t, None, 0.5)
        assert all(torch.equal(a, b) for a, b in zip(found["function"].apply(*flat), FUNCTION.apply(*flat)))
    assert calls == {"linear_distill": [], "distill": []}


def test_patch_options_and_summary(monkeypatch, capsys):
    tf_trl.patch()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    names = tf_trl.patched_names()
    want = ["trl.trainer.distillation_trainer._chunked_divergence_loss",
            "trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss"]
    if FUNCTION is not None:
        want += ["trl.trainer.distillation_trainer.ChunkedDivergenceFunction",
                 "trl.kernels.chunked_divergence.ChunkedDivergenceFunction"]
    for name in want:
        assert name in names, names
    assert "GKDTrainer.generalized_jsd_loss" in line and "_chunked_divergence_loss" in line
    left = line.split("left to TRL", 1)[1] if "left to TRL" in line else ""
    assert "ivergence" not in left and "jsd" not in left, line
    tf_trl.patch(distill=False)  # other options: unpatch, then patch again without the route
    assert "left to TRL: the distillation divergence (distill=False)" in capsys.readouterr().err
    assert not any("ivergence" in n or "jsd" in n for n in tf_trl.patched_names())
    assert gkd_mod.GKDTrainer.__dict__["generalized_jsd_loss"] is GKD_LOSS
    assert dist_mod._chunked_divergence_loss is LOSS and getattr(dist_mod, "ChunkedDivergenceFunction", None) is FUNCTION
    tf_trl.unpatch()
    # GKDTrainer is routed where trl.experimental.gkd is loaded; one loaded after patch() is routed
    # by patch() called again (patch() itself does not import TRL's experimental modules)
    monkeypatch.delitem(sys.modules, "trl.experimental.gkd.gkd_trainer")
    tf_trl.patch()
    assert "trl.trainer.distillation_trainer._chunked_divergence_loss" in tf_trl.patched_names()
    assert gkd_mod.GKDTrainer.__dict__["generalized_jsd_loss"] is GKD_LOSS
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "trl.experimental.gkd.gkd_trainer", gkd_mod)
    tf_trl.patch()
    assert "GKDTrainer.generalized_jsd_loss" in capsys.readouterr().err
    assert gkd_mod.GKDTrainer.__dict__["generalized_jsd_loss"] is not GKD_LOSS
    tf_trl.unpatch()
    assert gkd_mod.GKDTrainer.__dict__["generalized_jsd_loss"] is GKD_LOSS
    assert dist_mod._chunked_divergence_loss is LOSS and getattr(cd_mod, "ChunkedDivergenceFunction", None) is FUNCTION


def test_forms_this_route_does_not_adapt(monkeypatch, capsys):
    def other_loss(student_hidden_states, teacher_hidden_states, mask, beta):  # another signature
        raise AssertionError("not called")

    monkeypatch.setattr(dist_mod, "_chunked_divergence_loss", other_loss)
    tf_trl.patch()
    line = capsys.readouterr().err
    assert "trl.trainer.distillation_trainer._chunked_divergence_loss(student_hidden_states, teacher" in line
    assert line.index("left to TRL") < line.index("_chunked_divergence_loss(student_hidden_states")
    assert "not the form of TRL" in line and dist_mod._chunked_divergence_loss is other_loss
    tf_trl.unpatch()
    with pytest.raises(ValueError, match=r"patch\(distill=True\).*_chunked_divergence_loss"):
        tf_trl.patch(distill=True)
    assert not tf_trl.is_patched()
    # a TRL without DistillationTrainer's divergence: nothing to route by default, an error when required
    real = tf_trl._import_optional
    monkeypatch.setattr(tf_trl, "_import_optional",
                        lambda name: None if "distill" in name or "divergence" in name else real(name))
    tf_trl.patch()
    assert not any("ivergence" in n for n in tf_trl.patched_names())
    tf_trl.unpatch()
    with pytest.raises(ValueError, match=r"patch\(distill=True\): TRL .* has no DistillationTrainer divergence"):
        tf_trl.patch(distill=True)


@pytest.mark.cuda
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_divergence_loss_cuda(beta, calls):
    """On CUDA ours projects only the masked-in positions (as TRL 1.16's Triton path); bf16
    autocast as DistillationTrainer runs with bf16=True."""
    ours_fn = _adapters()["loss"]
    hid_s, hid_t, w_s, w_t, b_s, b_t, mask = (x.cuda() if x is not None else None for x in _heads(v=1000))
    hid_s = hid_s.detach().requires_grad_()
    w_s = w_s.detach().requires_grad_()
    args = _loss_args(hid_s, hid_t, w_s, w_t, mask, beta)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours, theirs = ours_fn(*args), LOSS(*args)
    assert torch.equal(ours[2], theirs[2])
    tol = 2e-2 if CHUNK_SIZE else 1e-4  # TRL 1.13 / 1.14 round the logits to bf16
    assert _rel(ours[0], theirs[0]) < tol and _rel(ours[1], theirs[1]) < tol, (ours, theirs)
    for a, b in zip(_grads(ours[0], (hid_s, w_s)), _grads(theirs[0], (hid_s, w_s))):
        assert _rel(a, b) < 2e-2, _rel(a, b)


def test_an_untested_version(monkeypatch):
    """Another TRL version: patch() refuses; patch(strict=False) routes what has a known form."""
    monkeypatch.setattr(trl, "__version__", "0.0.1")
    with pytest.raises(tf_trl.UnsupportedTRLVersion, match="0.0.1"):
        tf_trl.patch()
    with pytest.warns(UserWarning, match="0.0.1"):
        tf_trl.patch(strict=False, verbose=False)
    names = tf_trl.patched_names()
    assert "trl.trainer.distillation_trainer._chunked_divergence_loss" in names
    assert "trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss" in names
