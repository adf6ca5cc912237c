"""GRPO on packed batches: sequences laid end to end in one row with cu_seqlens, no padding.

    python examples/packed_grpo.py                          # CPU (or CUDA where present), under a minute
    python examples/packed_grpo.py --compile                # the loss under torch.compile(fullgraph=True, dynamic=True)
    python examples/packed_grpo.py --mode seq-mean-token-sum-norm

The toy task of examples/grpo_step.py: the reward of a completion is the fraction of its tokens
whose id is a multiple of --target-mod, and token 1 (EOS) ends a completion early. Each step:

1. samples --group-size completions for each of --prompts prompts of random lengths (1 to
   --prompt-len tokens) and cuts each sequence after its first EOS: the sequences have different
   lengths;
2. packs them into one row ``ids [1, T]`` with ``cu_seqlens`` (int32 ``[S+1]``, FlashAttention's
   cumulative lengths), and a completion mask ``[1, T]``; no padding token is stored or computed;
3. runs the policy on the packed row: attention stays inside each sequence (a block-diagonal
   causal mask here; ``flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, ...)`` on a GPU) and
   positions restart at 0 in each sequence;
4. scores the next tokens without crossing a boundary, from the last hidden states and
   lm_head.weight:
       targets = torch_fused.packed_targets(ids, cu_seqlens)       # -100 at each sequence's last position
       keep = torch_fused.packed_targets(completion, cu_seqlens, 0)  # the target is a completion token
       logp, ent = torch_fused.linear_logprobs_and_entropy(hidden, lm_head.weight, targets)
5. the PPO-clipped objective (one update per batch: ratio 1, gradient d logp) minus an entropy
   bonus, reduced per sequence as the padded layout would be:
       torch_fused.aggregate_loss(per_token, keep, mode, cu_seqlens=cu_seqlens, norm_len=completion_len)
   (``norm_len``, the padded length, only for seq-mean-token-sum-norm);
6. one AdamW step.

Every step also computes the same loss on the padded batch (``shift=True``, no cu_seqlens) and
checks that the two agree. At the end the script checks that the losses are finite, that packed
and padded agreed, and that the mean reward of the last steps beats that of the first steps, and
raises otherwise (--no-check to only print).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import torch_fused
from torch_fused.masked import AGG_MODES

EOS = 1
AGREE_TOL = 1e-4  # |packed - padded| <= AGREE_TOL * (1 + |padded|): float32 rounding of two layouts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="completions sampled per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--completion-len", type=int, default=8)
    p.add_argument("--target-mod", type=int, default=4, help="the reward counts tokens with id %% target_mod == 0")
    p.add_argument("--mode", default="seq-mean-token-mean", choices=AGG_MODES, help="aggregate_loss's mode")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--entropy-coef", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true",
                   help="compile the packed loss with torch.compile(fullgraph=True, dynamic=True): one graph for "
                        "every packed length and sequence count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="print only; do not raise if a check fails")
    args = p.parse_args(argv)
    for name in ("steps", "vocab", "hidden", "layers", "heads", "prompts", "prompt_len", "completion_len",
                 "target_mod"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        p.error(f"--group-size: expected >= 2 (advantages are relative to the group), got {args.group_size}")
    if args.hidden % args.heads:
        p.error(f"--hidden: expected a multiple of --heads ({args.heads}), got {args.hidden}")
    if args.vocab <= max(EOS, args.target_mod):
        p.error(f"--vocab: expected more than {max(EOS, args.target_mod)} tokens, got {args.vocab}")
    return args


def segments(cu_seqlens, length):
    """The sequence of each packed position (0-based), [length]."""
    pos = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, pos, right=True) - 1


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x, attn_mask):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if attn_mask is None:  # a padded batch: causal, and trailing padding is never attended to
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Policy(nn.Module):
    """A small decoder: token + position embeddings, pre-norm blocks, final RMSNorm, lm_head. With
    cu_seqlens the row ids [1, T] holds packed sequences: attention stays inside each one (a
    block-diagonal causal mask) and positions restart at each sequence's start."""

    def __init__(self, vocab, d, layers, heads, max_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def hidden(self, ids, cu_seqlens=None):
        length = ids.shape[1]
        pos = torch.arange(length, device=ids.device)
        mask = None
        if cu_seqlens is not None:
            seg = segments(cu_seqlens, length)
            pos = pos - cu_seqlens[seg].long()
            mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
        x = self.embed(ids) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.norm(x)


@torch.no_grad()
def sample(model, prompts, n_new, gen):
    """Autoregressive sampling at temperature 1 (no KV cache: the policy is small)."""
    seq = prompts
    for _ in range(n_new):
        probs = torch.softmax(model.lm_head(model.hidden(seq)[:, -1]).float(), -1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], 1)
    return seq


def rollouts(model, args, gen, device):
    """--group-size completions of each of --prompts prompts of random lengths (1 to --prompt-len):
    the sequences (prompt + completion up to and including its first EOS, 1-D) and the prompt
    length of each."""
    seqs, prompt_lens = [], []
    for _ in range(args.prompts):
        n = int(torch.randint(1, args.prompt_len + 1, (1,), device=device, generator=gen))
        prompt = torch.randint(2, args.vocab, (1, n), device=device, generator=gen)
        for row in sample(model, prompt.expand(args.group_size, n), args.completion_len, gen):
            eos = (row[n:] == EOS).nonzero()
            seqs.append(row[: n + int(eos[0]) + 1] if len(eos) else row)
            prompt_lens.append(n)
    return seqs, torch.tensor(prompt_lens, device=device)


def pack(seqs, prompt_lens):
    """The sequences laid end to end: ids [1, T], the completion mask [1, T] (True on completion
    tokens), cu_seqlens (int32 [S+1]) and the lengths [S]."""
    lengths = torch.tensor([len(q) for q in seqs], device=prompt_lens.device)
    completion = torch.cat([torch.arange(len(q), device=q.device) >= n for q, n in zip(seqs, prompt_lens.tolist())])
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return torch.cat(seqs)[None], completion[None], cu_seqlens, lengths


def rewards(seqs, prompt_lens, target_mod):
    """The fraction of each completion's tokens whose id is a multiple of target_mod (EOS excluded)."""
    out = []
    for q, n in zip(seqs, prompt_lens.tolist()):
        comp = q[n:]
        out.append(((comp % target_mod == 0) & (comp != EOS)).float().mean())
    return torch.stack(out)


def _objective(logp, ent, adv, clip_eps, entropy_coef):
    ratio = torch.exp(logp - logp.detach())  # on-policy: old log-probs = these, detached
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps)) - entropy_coef * ent


def packed_loss(model, ids, cu_seqlens, adv_tok, completion, mode, norm_len, clip_eps, entropy_coef):
    """The loss on a packed row: ids, adv_tok (each token's sequence advantage) and completion
    are [1, T]; cu_seqlens [S+1]."""
    hidden = model.hidden(ids, cu_seqlens)
    targets = torch_fused.packed_targets(ids, cu_seqlens)  # the next token of the same sequence, else -100
    keep = torch_fused.packed_targets(completion, cu_seqlens, 0)  # the target is a completion token
    logp, ent = torch_fused.linear_logprobs_and_entropy(hidden, model.lm_head.weight, targets)
    per_token = _objective(logp, ent, adv_tok, clip_eps, entropy_coef)
    loss = torch_fused.aggregate_loss(per_token, keep, mode, cu_seqlens=cu_seqlens, norm_len=norm_len)
    return loss, torch_fused.masked_mean(ent.detach(), keep)


def padded_loss(model, seqs, prompt_lens, adv, mode, norm_len, clip_eps, entropy_coef):
    """The same loss on the padded batch [S, L_max] (right padding, causal attention: no real token
    sees a pad; shift=True: position t scores token t + 1)."""
    seq = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
    lengths = torch.tensor([len(q) for q in seqs], device=seq.device)
    hidden = model.hidden(seq)
    logp, ent = torch_fused.linear_logprobs_and_entropy(hidden, model.lm_head.weight, seq[:, 1:], shift=True)
    t = torch.arange(1, seq.shape[1], device=seq.device)[None, :]
    keep = (t >= prompt_lens[:, None]) & (t < lengths[:, None])  # the scored token is a completion token
    per_token = _objective(logp, ent, adv[:, None], clip_eps, entropy_coef)
    return torch_fused.aggregate_loss(per_token, keep, mode, norm_len=norm_len)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    max_len = args.prompt_len + args.completion_len
    model = Policy(args.vocab, args.hidden, args.layers, args.heads, max_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = torch.compile(packed_loss, fullgraph=True, dynamic=True) if args.compile else packed_loss
    norm_len = args.completion_len if args.mode == "seq-mean-token-sum-norm" else None
    if args.compile:
        torch._dynamo.utils.counters.clear()
    gen = torch.Generator(device=device).manual_seed(args.seed)
    history = dict(loss=[], reward=[], entropy=[], gap=[], tokens=[], padded_tokens=[])
    for step in range(args.steps):
        model.eval()
        seqs, prompt_lens = rollouts(model, args, gen, device)
        model.train()
        r = rewards(seqs, prompt_lens, args.target_mod)
        g = r.view(args.prompts, args.group_size)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        ids, completion, cu_seqlens, lengths = pack(seqs, prompt_lens)
        adv_tok = adv.repeat_interleave(lengths)[None]
        loss, ent = loss_fn(model, ids, cu_seqlens, adv_tok, completion, args.mode, norm_len, args.clip_eps,
                            args.entropy_coef)
        with torch.no_grad():
            ref = padded_loss(model, seqs, prompt_lens, adv, args.mode, norm_len, args.clip_eps, args.entropy_coef)
        padded_tokens = len(seqs) * int(lengths.max())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history["loss"].append(loss.item())
        history["reward"].append(r.mean().item())
        history["entropy"].append(ent.item())
        history["gap"].append(abs(loss.item() - ref.item()) / (1 + abs(ref.item())))
        history["tokens"].append(ids.shape[1])
        history["padded_tokens"].append(padded_tokens)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():+.4f} (padded {ref.item():+.4f})  mean reward "
                  f"{r.mean().item():.3f}  {ids.shape[1]} packed tokens for {padded_tokens} padded", flush=True)
    if args.compile:
        history["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(f"torch.compile made {history['graphs']} graph(s) for {len(set(history['tokens']))} packed lengths")
    if not args.no_check:
        check(history)
    return history


def check(history, window=None):
    """Raise unless every loss is finite, packed and padded agreed at every step, and the mean
    reward of the last steps beats the first."""
    bad = [i for i, v in enumerate(history["loss"]) if not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"non-finite loss at steps {bad}")
    off = [i for i, v in enumerate(history["gap"]) if not v <= AGREE_TOL]
    if off:
        raise RuntimeError(f"the packed loss differs from the padded layout's at steps {off}")
    n = len(history["reward"])
    w = window or max(1, n // 4)
    first, last = sum(history["reward"][:w]) / w, sum(history["reward"][-w:]) / w
    if n < 2 or not last > first:
        raise RuntimeError(f"the mean reward did not rise: {first:.3f} over the first {w} steps, "
                           f"{last:.3f} over the last {w}")
    saved = 1 - sum(history["tokens"]) / sum(history["padded_tokens"])
    print(f"mean reward {first:.3f} -> {last:.3f} (first / last {w} steps); packed equals padded at every step; "
          f"packing saved {saved:.0%} of the tokens")


if __name__ == "__main__":
    main()
