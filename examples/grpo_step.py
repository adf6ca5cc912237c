"""GRPO in plain PyTorch with torch_fused: the fused lm_head, the masked token mean and SinkGD.

    python examples/grpo_step.py                          # CPU (or CUDA where present), a minute or less
    python examples/grpo_step.py --device cuda --compile  # the loss under torch.compile(fullgraph=True)

A small decoder-only policy learns a toy task: the reward of a completion is the fraction of its
tokens whose id is a multiple of --target-mod (a random policy scores about 1 / --target-mod).
Each step:

1. samples --group-size completions of --completion-len tokens for each of --prompts random
   prompts (token 1 ends a completion early: the tokens after it are padding);
2. scores them and normalizes the rewards within each group (the GRPO advantage);
3. recomputes the log-probs of the sampled tokens with gradients, from the last hidden states and
   lm_head.weight, never holding the [B, S, V] logits:
       logp, ent = torch_fused.linear_logprobs_and_entropy(hidden, lm_head.weight, seq[:, 1:], shift=True)
   (shift=True: position t scores token t + 1, no slice of the hidden states);
4. the PPO-clipped objective against the detached log-probs (one update per batch, so the ratio
   is 1 and its gradient d logp), minus an entropy bonus, averaged over the completion tokens:
       torch_fused.aggregate_loss(per_token, mask, "token-mean")
5. one step of torch_fused.optim.SinkGD on the hidden matrices, AdamW (through SinkGD) on the
   embeddings, the head and the norms (sinkgd_param_groups).

At the end the script checks that the losses are finite and that the mean reward of the last
steps beats that of the first steps, and raises otherwise (--no-check to only print).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import torch_fused
from torch_fused.optim import SinkGD, sinkgd_param_groups

EOS = 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="completions sampled per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=16)
    p.add_argument("--target-mod", type=int, default=4, help="the reward counts tokens with id %% target_mod == 0")
    p.add_argument("--lr", type=float, default=0.05, help="SinkGD's lr (its step is lr * 0.05 per RMS-1 update)")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="lr of the AdamW group (embeddings, head, norms)")
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--entropy-coef", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true", help="compile the loss (model forward + fused head + "
                                                          "aggregation) with torch.compile(fullgraph=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="print only; do not raise if the reward does not rise")
    args = p.parse_args(argv)
    for name in ("steps", "vocab", "hidden", "layers", "heads", "prompts", "group_size", "prompt_len",
                 "completion_len", "target_mod"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        p.error(f"--group-size: expected >= 2 (advantages are relative to the group), got {args.group_size}")
    if args.hidden % args.heads:
        p.error(f"--hidden: expected a multiple of --heads ({args.heads}), got {args.hidden}")
    if args.vocab <= max(EOS, args.target_mod):
        p.error(f"--vocab: expected more than {max(EOS, args.target_mod)} tokens, got {args.vocab}")
    return args


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 8 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Policy(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-norm blocks (SDPA causal
    attention, SwiGLU MLP), final RMSNorm, untied lm_head."""

    def __init__(self, vocab, d, layers, heads, max_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def hidden(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


@torch.no_grad()
def sample(model, prompts, n_new, gen):
    """Autoregressive sampling at temperature 1 (no KV cache: the policy is small)."""
    seq = prompts
    for _ in range(n_new):
        probs = torch.softmax(model.lm_head(model.hidden(seq)[:, -1]).float(), -1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], 1)
    return seq


def completion_mask(seq, prompt_len):
    """[B, S-1] bool: position t predicts token t + 1, a completion token up to and including the
    first EOS."""
    comp = seq[:, prompt_len:]
    after_eos = (comp == EOS).long().cumsum(1) - (comp == EOS).long() > 0  # strictly after the first EOS
    keep = torch.zeros_like(seq, dtype=torch.bool)
    keep[:, prompt_len:] = ~after_eos
    return keep[:, 1:]


def rewards(seq, mask, prompt_len, target_mod):
    tok = seq[:, 1:]
    hit = (tok % target_mod == 0) & (tok != EOS) & mask
    return hit.sum(1).float() / mask[:, prompt_len - 1:].sum(1).clamp_min(1)


def grpo_loss(model, seq, adv, mask, clip_eps, entropy_coef):
    hidden = model.hidden(seq)  # [B, S, H]: S - 1 positions predict seq[:, 1:]
    logp, ent = torch_fused.linear_logprobs_and_entropy(hidden, model.lm_head.weight, seq[:, 1:], shift=True)
    ratio = torch.exp(logp - logp.detach())  # on-policy: old log-probs = these, detached
    a = adv[:, None]
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_eps, 1 + clip_eps)) - entropy_coef * ent
    loss = torch_fused.aggregate_loss(per_token, mask, "token-mean")
    return loss, torch_fused.masked_mean(ent.detach(), mask)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    max_len = args.prompt_len + args.completion_len
    model = Policy(args.vocab, args.hidden, args.layers, args.heads, max_len).to(device)
    opt = SinkGD(sinkgd_param_groups(model, lr=args.adamw_lr), lr=args.lr)
    loss_fn = torch.compile(grpo_loss, fullgraph=True) if args.compile else grpo_loss
    print(f"device {device}; the loss (model forward, fused head, aggregation) runs "
          + ("under torch.compile(fullgraph=True), compiled at the first step" if args.compile else "eagerly"),
          flush=True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    history = dict(loss=[], reward=[], entropy=[])
    for step in range(args.steps):
        prompts = torch.randint(2, args.vocab, (args.prompts, args.prompt_len), device=device, generator=gen)
        model.eval()
        seq = sample(model, prompts.repeat_interleave(args.group_size, 0), args.completion_len, gen)
        model.train()
        mask = completion_mask(seq, args.prompt_len)
        r = rewards(seq, mask, args.prompt_len, args.target_mod)
        g = r.view(args.prompts, args.group_size)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        t0 = time.perf_counter()
        loss, ent = loss_fn(model, seq, adv, mask, args.clip_eps, args.entropy_coef)
        loss.backward()
        if args.compile and step == 0:  # fullgraph=True: a graph break would have raised in loss_fn
            print(f"compiled the loss and its backward on {device} (fullgraph=True: no graph break) in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history["loss"].append(loss.item())
        history["reward"].append(r.mean().item())
        history["entropy"].append(ent.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():+.4f}  mean reward {r.mean().item():.3f}  "
                  f"entropy {ent.item():.3f}", flush=True)
    if not args.no_check:
        check(history)
    return history


def check(history, window=None):
    """Raise unless every loss is finite and the mean reward of the last steps beats the first."""
    bad = [i for i, v in enumerate(history["loss"]) if not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"non-finite loss at steps {bad}")
    n = len(history["reward"])
    w = window or max(1, n // 4)
    first, last = sum(history["reward"][:w]) / w, sum(history["reward"][-w:]) / w
    if n < 2 or not last > first:
        raise RuntimeError(f"the mean reward did not rise: {first:.3f} over the first {w} steps, "
                           f"{last:.3f} over the last {w}")
    print(f"mean reward {first:.3f} -> {last:.3f} (first / last {w} steps)")


if __name__ == "__main__":
    main()
