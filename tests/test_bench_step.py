"""The training-step benchmark's model (torch_fused/bench/step.py) at tiny sizes on CPU: grouped-query
attention and activation checkpointing, which the Llama-3-8B suite (step_8b) relies on, compute
what the plain model computes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torch_fused._library import INTERPRET

from torch_fused.bench import step as S

CFG = replace(S.TINY, heads=4, hidden=32, intermediate=64, seq=17, prompt=4)


def test_grouped_query_attention_is_attention_with_shared_heads():
    """A block with 2 key/value heads for 4 query heads equals the 4-head block whose key and value
    heads 2j and 2j+1 are both the grouped block's head j."""
    torch.manual_seed(0)
    gqa = S.Block(replace(CFG, kv_heads=2), dtype=torch.float32)
    mha = S.Block(CFG, dtype=torch.float32)
    hd = CFG.hidden // CFG.heads
    w = gqa.qkv.weight.detach()  # [(4 + 2 + 2) * hd, H]
    q, k, v = w.split([4 * hd, 2 * hd, 2 * hd])
    k_full = k.view(2, hd, -1).repeat_interleave(2, 0).reshape(4 * hd, -1)
    v_full = v.view(2, hd, -1).repeat_interleave(2, 0).reshape(4 * hd, -1)
    with torch.no_grad():
        mha.load_state_dict({**gqa.state_dict(), "qkv.weight": torch.cat([q, k_full, v_full])})
    x = torch.randn(2, CFG.seq, CFG.hidden)
    cos, sin = S.rope_tables(CFG.seq, hd, CFG.rope_theta, "cpu", torch.float32)
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), rtol=1e-5, atol=1e-6)
    assert gqa.qkv.weight.shape[0] == 8 * hd  # fewer key/value parameters than the full block's


@pytest.mark.skipif(INTERPRET, reason="the step harness's checkpointing: the plain CPU run covers it (its "
                    "kernels are the op tests')")
@pytest.mark.parametrize("kv_heads", [0, 2])
def test_checkpointed_blocks_give_the_same_loss_and_gradients(kv_heads):
    cfg = replace(CFG, kv_heads=kv_heads)
    model = S.Model(cfg, "cpu")
    ids, adv, mask = S.make_batch(cfg, 2, "cpu")
    grads = []
    for fn in (None, S.checkpointed(S._block_call)):
        model.zero_grad(set_to_none=True)
        x = model.trunk(ids, fn)
        loss, _ = S.head_torch_fused(model, x, ids, adv, mask, cfg.clip_eps, cfg.entropy_coef)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_8b_preset_is_llama3_8b():
    cfg = S.LLAMA3_8B
    cfg.check()
    hd = cfg.hidden // cfg.heads
    per_layer = (cfg.hidden * (cfg.heads + 2 * cfg.kv_heads) * hd + cfg.hidden * cfg.hidden
                 + 3 * cfg.hidden * cfg.intermediate + 2 * cfg.hidden)
    n = cfg.layers * per_layer + 2 * cfg.vocab * cfg.hidden + cfg.hidden
    assert n == 8_030_261_248  # Llama-3-8B's parameter count
    assert cfg.checkpoint and cfg.stochastic_round


@pytest.mark.parametrize("kv_heads", [3, -1])
def test_kv_heads_must_divide_heads(kv_heads):
    with pytest.raises(ValueError, match="kv_heads"):
        replace(CFG, kv_heads=kv_heads).check()
