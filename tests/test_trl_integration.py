"""torch_fused.integrations.trl against the installed TRL, on CPU.

A client test (GRPOTrainer, two steps, a tiny Qwen2 made from a config and a tokenizer built
here: nothing is downloaded) with TRL's own path and with patch(), plus each adapter against
TRL's original function: values, dtypes, gradients, row masks, fallbacks, patch/unpatch.

Needs the optional `trl` extra (pip install -e '.[trl]'); skipped without it. Skipped in the
TRITON_INTERPRET=1 run too: the adapters call the public torch_fused functions, whose kernels the
plain run's op tests and the interpreter run already cover, and a trainer under the interpreter
would take minutes.
"""

import dataclasses
import importlib
import importlib.util
import sys

import pytest
import torch

from torch_fused._library import INTERPRET

if INTERPRET:
    pytest.skip("TRL client test: the plain CPU run covers it (too slow under TRITON_INTERPRET=1)",
                allow_module_level=True)

_HOW = "the TRL integration test needs the trl extra: pip install -e '.[trl]'"
trl = pytest.importorskip("trl", reason=_HOW)
pytest.importorskip("transformers", reason=_HOW)
pytest.importorskip("datasets", reason=_HOW)
pytest.importorskip("accelerate", reason=_HOW)

import trl.trainer.utils as trl_utils  # noqa: E402

import torch_fused  # noqa: E402
from torch_fused.integrations import trl as tf_trl  # noqa: E402

VERSION = trl.__version__
if VERSION not in tf_trl.TESTED_TRL_VERSIONS:
    pytest.skip(f"TRL {VERSION} is not a tested version ({', '.join(tf_trl.TESTED_TRL_VERSIONS)}): "
                "pip install -e '.[trl]'", allow_module_level=True)
# TRL 1.16: every GRPOTrainer log-prob goes through the chunked lm_head (add_fused_lm_head)
HAS_FUSED_HEAD = VERSION in tf_trl.FUSED_LM_HEAD_TRL_VERSIONS
kernels = importlib.import_module("trl.kernels") if importlib.util.find_spec("trl.kernels") else None

ORIG = {name: getattr(trl_utils, name) for name in
        ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy",
         "_ChunkedLogProbFunction") if hasattr(trl_utils, name)}
KERNEL_ORIG = getattr(kernels, "selective_log_softmax_and_entropy", None) if kernels is not None else None
FOUR_ARG = "temperature" in ORIG["selective_log_softmax"].__code__.co_varnames


@pytest.fixture(autouse=True)
def _unpatched():
    tf_trl.unpatch()
    yield
    tf_trl.unpatch()


@pytest.fixture
def calls(monkeypatch):
    """Counts of calls into the torch_fused functions the adapters route to."""
    counts = dict.fromkeys(["selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy",
                            "linear_logprobs_and_entropy"], 0)
    for name in counts:
        fn = getattr(torch_fused, name)

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(torch_fused, name, counted)
    return counts


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# the client: GRPOTrainer, two steps


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(253)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _reward(completions, **kwargs):
    # varies between the completions of a prompt, so the advantages are not all zero
    return [sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit()) / 10.0 for c in completions]


def _grpo_run(tmp_path):
    """Two GRPO steps from a fixed model and seed; (per-step logs, parameters before, after)."""
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10 w11"]})
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    kwargs = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=8, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
                  temperature=0.7, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
                  disable_tqdm=True, dataloader_num_workers=0, bf16=False)  # TRL's default bf16 autocasts on CPU
    if "entropy_coef" in fields:  # an entropy bonus, so the entropy gradient counts too
        kwargs["entropy_coef"] = 0.05
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=GRPOConfig(**kwargs), train_dataset=prompts,
                          processing_class=_tokenizer())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return logs, before, after


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    return _grpo_run(tmp_path_factory.mktemp("grpo_trl"))


def _assert_same_training(run, ref, *, exact=False):
    logs, before, after = run
    ref_logs, ref_before, ref_after = ref
    assert len(logs) == len(ref_logs) == 2
    for n in ref_before:
        assert torch.equal(before[n], ref_before[n]), f"{n}: the runs started from different weights"
    for step, (a, b) in enumerate(zip(logs, ref_logs)):
        for key in ("loss", "entropy", "grad_norm", "reward"):
            if key in b:
                tol = 0.0 if exact else 1e-5 * max(1.0, abs(b[key]))
                assert abs(a[key] - b[key]) <= tol, f"step {step + 1} {key}: {a[key]} vs TRL's {b[key]}"
    assert any(logs[i]["grad_norm"] > 1e-3 for i in range(2)), "the steps did not train (no gradient)"
    # parameter updates (SGD: the summed gradients): fp32 on CPU, so agree to ~1e-6 relative
    for n in ref_before:
        d, ref_d = after[n] - before[n], ref_after[n] - ref_before[n]
        if exact:
            assert torch.equal(d, ref_d), n
        else:
            assert _rel(d, ref_d) < 2e-4, f"{n}: update differs from TRL's by {_rel(d, ref_d):.2e} (relative)"


def test_grpo_patch_default(trl_run, tmp_path, calls, capsys):
    tf_trl.patch()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"torch_fused.integrations.trl: TRL {VERSION}: routed "), line
    run = _grpo_run(tmp_path)
    if HAS_FUSED_HEAD:
        # TRL 1.16 computes GRPO's log-probs in its chunked lm_head only: the default patch()
        # routes it (the loss's log-probs and entropy, once per step)
        assert "ChunkedLogProbFunction" in line and "left to TRL" not in line, line
        assert calls["linear_logprobs_and_entropy"] >= 2, calls
        _assert_same_training(run, trl_run)
    else:
        # TRL 1.13 / 1.14: GRPOTrainer scores materialized logits (1.13: selective_log_softmax and
        # entropy_from_logits; 1.14: selective_log_softmax_and_entropy with temperature and row_mask)
        logp_calls = calls["selective_log_softmax"] + calls["logprobs_and_entropy"]
        entropy_calls = calls["entropy_from_logits"] + calls["logprobs_and_entropy"]
        assert logp_calls >= 2 and entropy_calls >= 2, calls
        _assert_same_training(run, trl_run)


@pytest.mark.skipif(not HAS_FUSED_HEAD, reason=f"TRL {VERSION} has no fused lm_head path")
def test_grpo_patch_without_the_lm_head_route(trl_run, tmp_path, calls, capsys):
    tf_trl.patch(fused_lm_head=False)
    assert "left to TRL: the chunked lm_head (fused_lm_head=False)" in capsys.readouterr().err
    run = _grpo_run(tmp_path)
    # TRL 1.16 computes GRPO's log-probs in its chunked lm_head only: with that route off nothing
    # of it reaches torch_fused, and the run is TRL's, bit for bit
    assert sum(calls.values()) == 0, calls
    assert trl_utils._ChunkedLogProbFunction is ORIG["_ChunkedLogProbFunction"]
    _assert_same_training(run, trl_run, exact=True)


# ------------------------------------------------------------------------------------------------
# each adapter against TRL's function


def _adapters(**options):
    """The replacements patch() installs in trl.trainer.utils (and trl.kernels), taken out again:
    the tests call them beside TRL's originals while unpatched, so that the originals (whose
    PyTorch paths call each other through the module's names) are TRL's own all the way down."""
    tf_trl.patch(**options)
    found = {name: getattr(trl_utils, name) for name in ORIG}
    if KERNEL_ORIG is not None:
        found["kernel"] = kernels.selective_log_softmax_and_entropy
    tf_trl.unpatch()
    for name, orig in ORIG.items():
        assert getattr(trl_utils, name) is orig
    return found


def _logits(dtype, shape=(3, 5, 37), seed=0):
    g = torch.Generator().manual_seed(seed)
    # (no -inf entries: TRL's PyTorch entropy gives NaN for a row holding one, ours its finite entropy)
    return (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_()


def _index(shape, v, seed=1):
    return torch.randint(0, v, shape, generator=torch.Generator().manual_seed(seed))


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-9}


def _check(ours, theirs, inputs, tol):
    """Values, dtypes, shapes, requires_grad and d inputs of matching outputs (tuples or tensors)."""
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    assert len(ours) == len(theirs)
    for o, t in zip(ours, theirs):
        assert (o is None) == (t is None)
        if t is None:
            continue
        assert o.dtype == t.dtype and o.shape == t.shape, (o.dtype, t.dtype, o.shape, t.shape)
        assert o.requires_grad == t.requires_grad
        if o.dtype == torch.bool:
            assert torch.equal(o, t)
        else:
            assert _rel(o.detach(), t.detach()) < tol, _rel(o.detach(), t.detach())
    diff = [(o, t) for o, t in zip(ours, theirs) if t is not None and t.requires_grad]
    if not diff:
        return
    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) for _, t in diff]
    grads_o = torch.autograd.grad(sum((o * w).sum() for (o, _), w in zip(diff, ws)), inputs)
    grads_t = torch.autograd.grad(sum((t * w).sum() for (_, t), w in zip(diff, ws)), inputs)
    for go, gt in zip(grads_o, grads_t):
        assert go.dtype == gt.dtype
        assert _rel(go, gt) < tol * 10, _rel(go, gt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax(dtype, calls):
    fn, orig = _adapters()["selective_log_softmax"], ORIG["selective_log_softmax"]
    assert fn is not orig
    logits = _logits(dtype)
    for index in (_index((3, 5), 37), _index((3, 5, 4), 37)):  # one id per row, or K per row
        _check(fn(logits, index), orig(logits, index), (logits,), TOL[dtype])
    if FOUR_ARG:
        index = _index((3, 5), 37)
        mask = torch.ones(3, 5, dtype=torch.bool)
        mask[1, 2:] = False
        bad = index.masked_fill(~mask, 10**6)  # masked rows are never read
        ours = fn(logits, bad, temperature=0.7, row_mask=mask)
        _check(ours, orig(logits, index, 0.7, mask), (logits,), TOL[dtype])
        assert (ours[~mask] == 0).all()
        with pytest.raises(ValueError, match="temperature"):
            fn(logits, index, temperature=0.0)
    assert calls["selective_log_softmax"] >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits(dtype, calls):
    fn, orig = _adapters()["entropy_from_logits"], ORIG["entropy_from_logits"]
    logits = _logits(dtype)
    _check(fn(logits), orig(logits), (logits,), TOL[dtype])
    _check(fn(logits, chunk_size=2), orig(logits, 2), (logits,), TOL[dtype])
    assert calls["entropy_from_logits"] == 2


@pytest.mark.skipif("selective_log_softmax_and_entropy" not in ORIG, reason=f"not in TRL {VERSION}")
@pytest.mark.parametrize("entropy_requires_grad", [True, False])
def test_selective_log_softmax_and_entropy(entropy_requires_grad, calls):
    found = _adapters()
    fn, orig = found["selective_log_softmax_and_entropy"], ORIG["selective_log_softmax_and_entropy"]
    logits = _logits(torch.float32)
    index = _index((3, 5), 37)
    mask = torch.ones(3, 5, dtype=torch.int64)
    mask[2, :3] = 0
    for args in ((entropy_requires_grad,), (entropy_requires_grad, 1.3, mask)):
        _check(fn(logits, index, *args), orig(logits, index, *args), (logits,), TOL[torch.float32])
    assert calls["logprobs_and_entropy"] == 2
    if KERNEL_ORIG is not None:  # TRL's Triton kernel (CUDA only): ours has its call form on CPU too
        logp, ent = found["kernel"](logits, index, 1.3, mask)
        ref_lp, ref_ent = orig(logits, index, True, 1.3, mask)
        assert logp.dtype == ent.dtype == torch.float32
        assert _rel(logp, ref_lp) < 1e-5 and _rel(ent, ref_ent) < 1e-5


@pytest.mark.skipif(not hasattr(trl_utils, "_supports_trl_loss_kernel"), reason=f"not in TRL {VERSION}")
def test_output_dtypes_follow_trl_kernel_rule(monkeypatch):
    """Where TRL's kernel would run (simulated on the CPU: its support rule without the device
    test), the adapter returns TRL's dtypes: float32 from the kernel, and with a float row mask
    (outside the kernel) log-probs in the logits' dtype but the entropy float32, as TRL's
    entropy_from_logits still takes the kernel."""
    rule = trl_utils._supports_trl_loss_kernel

    def cpu_rule(logits, index=None, row_mask=None):
        return rule(_AsCuda(logits), None if index is None else _AsCuda(index),
                    None if row_mask is None else _AsCuda(row_mask))

    monkeypatch.setattr(trl_utils, "_supports_trl_loss_kernel", cpu_rule)
    fn = _adapters()["selective_log_softmax_and_entropy"]
    logits = _logits(torch.bfloat16)
    index = _index((3, 5), 37)
    for mask, want in ((None, (torch.float32, torch.float32)),
                       (torch.ones(3, 5, dtype=torch.bool), (torch.float32, torch.float32)),
                       (torch.ones(3, 5), (torch.bfloat16, torch.float32))):
        logp, ent = fn(logits, index, True, 1.0, mask)
        assert (logp.dtype, ent.dtype) == want, (mask if mask is None else mask.dtype, logp.dtype, ent.dtype)


class _AsCuda:
    """A tensor's attributes that TRL's support rule reads, with the device reported as CUDA."""

    def __init__(self, t):
        self._t = t
        self.device = torch.device("cuda", 0)

    def __getattr__(self, name):
        return getattr(self._t, name)


def test_fallback_to_trl(calls):
    """Calls outside the fused ops' semantics go to TRL's function, unchanged."""
    fn, orig = _adapters()["selective_log_softmax"], ORIG["selective_log_softmax"]
    logits = _logits(torch.float32)
    index = _index((3, 5), 37)
    cases = [(logits, index.to(torch.int16)), (logits, index[:, :4]), (logits[0, 0], index[0, 0])]
    if FOUR_ARG:
        cases.append((logits, index, torch.tensor(0.7)))
    for args in cases:
        try:
            expected = orig(*args)
        except Exception as e:  # noqa: BLE001 - the adapter must raise what TRL raises
            with pytest.raises(type(e)):
                fn(*args)
        else:
            assert torch.equal(fn(*args), expected)
    assert sum(calls.values()) == 0, calls


@pytest.mark.skipif(not HAS_FUSED_HEAD, reason=f"TRL {VERSION} has no fused lm_head path")
@pytest.mark.parametrize("case", ["fp32", "softcap_scale_bias", "bf16_autocast", "log_probs_only"])
def test_chunked_lm_head(case, calls):
    orig = ORIG["_ChunkedLogProbFunction"]
    fn = _adapters(fused_lm_head=True)["_ChunkedLogProbFunction"]
    assert fn is not orig
    g = torch.Generator().manual_seed(3)
    n, h, v = 23, 16, 67
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    # is_top1: row 0's largest logits tie at columns 10 and 11 and its target is 11 (False: the first
    # maximum counts); row 1's target is its argmax (True); targets in the first and last column
    weight[10] = weight[11] = hidden[0] * 3
    weight[20] = hidden[1] * 3
    targets[:4] = torch.tensor([11, 20, 0, v - 1])
    hidden.requires_grad_()
    weight.requires_grad_()
    bias = None
    if case == "softcap_scale_bias":
        bias = torch.randn(v, generator=g) * 0.1
        bias[11] = bias[10]  # keep the tie
        bias.requires_grad_()
    softcap, scale = (5.0, 0.8) if case == "softcap_scale_bias" else (None, 1.0)
    outputs = ("log_probs",) if case == "log_probs_only" else ("log_probs", "entropy", "log_sum_sq_probs",
                                                                  "mean_logits", "is_top1")
    args = (hidden, weight, bias, targets, 0.7, 16, softcap, scale, outputs)  # chunk_size 16: several chunks
    inputs = tuple(x for x in (hidden, weight, bias) if x is not None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16_autocast"):
        ours, theirs = fn.apply(*args), orig.apply(*args)
    if case == "bf16_autocast":
        # is_top1 compares bf16-rounded logits, where near-ties may resolve either way
        _check(ours[:4], theirs[:4], inputs, 2e-2)
        # TRL's compute dtype under autocast is the autocast dtype: ours runs on the bf16 casts
        bf = torch_fused.linear_logprobs_and_entropy(hidden.detach().bfloat16(), weight.detach().bfloat16(), targets,
                                                     temperature=0.7)
        assert torch.equal(ours[0].detach(), bf[0]) and torch.equal(ours[1].detach(), bf[1])
    else:
        assert theirs[4] is None or (theirs[4][1] and not theirs[4][0])  # the tie rows above, as TRL reads them
        _check(ours, theirs, inputs, 1e-5)
    assert calls["linear_logprobs_and_entropy"] == 1 + (case == "bf16_autocast")


def test_patch_unpatch_idempotent():
    snapshot = {name: dict(vars(mod)) for name, mod in sys.modules.items()
                if mod is not None and (name == "trl" or name.startswith("trl."))}
    tf_trl.patch()
    first = dict(vars(trl_utils))
    tf_trl.patch()  # twice: the same adapters, nothing wrapped twice
    assert all(vars(trl_utils)[k] is v for k, v in first.items())
    names = tf_trl.patched_names()
    assert "trl.trainer.utils.selective_log_softmax" in names and "trl.trainer.utils.entropy_from_logits" in names
    if HAS_FUSED_HEAD:
        assert "trl.trainer.utils.selective_log_softmax_and_entropy" in names
    # the lm_head route is on by default wherever TRL has the form it adapts (1.16)
    assert any("ChunkedLogProb" in n for n in names) == HAS_FUSED_HEAD
    # a module imported after patch() takes the patched names; unpatch() restores it too
    late = importlib.import_module("trl.trainer.grpo_trainer")
    tf_trl.patch(fused_lm_head=False)  # other options: unpatch, then patch again
    assert not any("ChunkedLogProb" in n for n in tf_trl.patched_names())
    with tf_trl.patched():
        assert any("ChunkedLogProb" in n for n in tf_trl.patched_names()) == HAS_FUSED_HEAD
    assert tf_trl.is_patched() and not any("ChunkedLogProb" in n for n in tf_trl.patched_names())
    tf_trl.unpatch()
    tf_trl.unpatch()
    assert not tf_trl.is_patched() and tf_trl.patched_names() == []
    for name, d in snapshot.items():
        mod = sys.modules[name]
        for k, v in d.items():
            assert vars(mod).get(k) is v, f"{name}.{k} not restored"
    adapters_left = [f"{late.__name__}.{k}" for k, v in vars(late).items()
                     if getattr(v, "__module__", None) == tf_trl.__name__]
    assert adapters_left == []


def test_unsupported_version(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "0.0.1")
    with pytest.raises(tf_trl.UnsupportedTRLVersion) as err:
        tf_trl.patch()
    assert "0.0.1" in str(err.value) and all(v in str(err.value) for v in tf_trl.TESTED_TRL_VERSIONS)
    assert "strict=False" in str(err.value) and "pip install" in str(err.value)
    assert not tf_trl.is_patched()
    with pytest.warns(UserWarning, match="0.0.1"):
        tf_trl.patch(strict=False)  # same signatures as a tested version: patched, with a warning
    assert "trl.trainer.utils.selective_log_softmax" in tf_trl.patched_names()
    if not HAS_FUSED_HEAD:
        with pytest.raises(ValueError, match="fused_lm_head"):
            tf_trl.patch(fused_lm_head=True, strict=False)
