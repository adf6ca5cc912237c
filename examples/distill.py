"""Distil a frozen teacher into a student without either model's logits.

    python examples/distill.py                           # CPU or CUDA, tiny random models
    python examples/distill.py --teacher topk --k 8      # a top-k teacher (log-probs as a server sends them)
    python examples/distill.py --beta 0 --temperature 2  # forward KL(teacher || student), softened

A frozen teacher and a narrower student (token embeddings, residual MLP blocks, RMSNorm and an
untied lm_head; the same vocabulary) see the same random token sequences; the first --prompt
tokens of each are a prompt outside the loss. Each step trains the student on the divergence of
its next-token distributions from the teacher's at the completion positions:

    full teacher:  torch_fused.linear_distill(h_s, student.lm_head.weight, h_t, teacher.lm_head.weight,
                                              beta=beta, temperature=T, labels=labels, shift=True,
                                              reduction="token-mean")
    top-k teacher: the teacher's k most likely ids and their log-probs, then
                   torch_fused.linear_distill(h_s, student.lm_head.weight, teacher_topk_ids=ids,
                                              teacher_topk_logprobs=logprobs, tail="bucket", ...)

h_s and h_t are the models' last hidden states [B, L+1, H]; ``shift=True`` scores position t
against the next token's distribution, as a causal LM's logits[:, :-1]. ``beta`` is TRL's: 0 is
KL(teacher || student), 1 is KL(student || teacher), between them the generalized JSD. With
``reduction="token-mean"`` the student's gradients are formed in the forward pass and the backward
only scales them; ``"none"`` returns the per-token divergence instead (its backward recomputes
the heads).

At the first step the script checks the loss and the student's gradients against the
materialized formula (both heads' logits, log_softmax, TRL's generalized_jsd_loss form; for the
top-k teacher, TRL's tail bucket); at the end, that the divergence fell. It raises otherwise.
TRL users get the same ops through ``torch_fused.integrations.trl.patch()``, which routes
``DistillationTrainer``'s divergence and ``GKDTrainer.generalized_jsd_loss``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import torch_fused

# relative error norm allowed between the fused loss / gradients and the materialized formula's
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(TOL))
    p.add_argument("--teacher", default="full", choices=("full", "topk"),
                   help="full: the teacher's hidden states and lm_head; topk: its top --k log-probs")
    p.add_argument("--k", type=int, default=8, help="ids per position of the top-k teacher")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--prompt", type=int, default=8, help="leading tokens outside the loss")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--student-hidden", type=int, default=64)
    p.add_argument("--teacher-hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "vocab", "student_hidden", "teacher_hidden", "layers", "k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not 0 <= args.prompt < args.seq - 1:
        p.error(f"--prompt: expected 0 <= prompt < seq - 1 ({args.seq - 1}), got {args.prompt}")
    if not 0.0 <= args.beta <= 1.0:
        p.error(f"--beta: expected a value in [0, 1], got {args.beta}")
    if not args.temperature > 0:
        p.error(f"--temperature: expected > 0, got {args.temperature}")
    if args.teacher == "topk" and args.k > args.vocab:
        p.error(f"--k: expected at most --vocab ({args.vocab}), got {args.k}")
    return args


class LM(nn.Module):
    """Token embeddings, residual MLP blocks over a causal running mean of the sequence, RMSNorm,
    an untied lm_head. ``hidden(ids)`` gives the last hidden states [B, S, H]."""

    def __init__(self, vocab, width, layers, *, head_scale=1.0, **kw):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, **kw)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2 * width, 2 * width, **kw), nn.GELU(),
                                                  nn.Linear(2 * width, width, **kw)) for _ in range(layers))
        self.norm = nn.RMSNorm(width, **kw)
        self.lm_head = nn.Linear(width, vocab, bias=False, **kw)
        with torch.no_grad():
            self.lm_head.weight.mul_(head_scale)

    def hidden(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            ctx = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
            x = x + blk(torch.cat([x, ctx], -1))
        return self.norm(x)


def divergence_materialized(zs, lt, beta):
    """TRL's generalized_jsd_loss per position, from the student's logits (already divided by the
    temperature) and the teacher's log-probs (full [..., V], or the top-k with their tail bucket)."""
    ls = zs.log_softmax(-1)
    if beta == 0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1:
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logsumexp(torch.stack([ls + math.log1p(-beta), lt + math.log(beta)]), 0)
    return (beta * lt.exp() * (lt - lm) + (1 - beta) * ls.exp() * (ls - lm)).sum(-1)


def topk_materialized(zs, ids, lt, beta):
    """The top-k teacher's divergence with TRL's tail bucket: each side's log-probs at the k ids
    and a (k+1)-th category holding the rest of the mass."""
    ls = zs.log_softmax(-1).gather(-1, ids)

    def bucket(lp):
        return torch.cat([lp, torch.log1p(-lp.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-7))], -1)

    # the divergence over the k + 1 categories, written as over logits whose log_softmax they are
    return divergence_materialized(bucket(ls), bucket(lt), beta)


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    kw = dict(device=device, dtype=dtype)
    teacher = LM(args.vocab, args.teacher_hidden, args.layers, head_scale=8.0, **kw).requires_grad_(False)
    student = LM(args.vocab, args.student_hidden, args.layers, **kw)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)
    g = torch.Generator(device=device).manual_seed(args.seed)
    T, beta = args.temperature, args.beta
    hist = {"loss": [], "check": {}}
    print(f"student {sum(p.numel() for p in student.parameters()) / 1e3:.0f}k parameters (hidden "
          f"{args.student_hidden}), teacher {sum(p.numel() for p in teacher.parameters()) / 1e3:.0f}k (hidden "
          f"{args.teacher_hidden}), vocab {args.vocab}; {args.teacher} teacher, beta {beta}, temperature {T}")
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
        labels = ids[:, 1:].clone()
        labels[:, : args.prompt] = -100  # positions predicting a prompt token are not trained
        with torch.no_grad():
            h_t = teacher.hidden(ids)
        h_s = student.hidden(ids)
        w_s = student.lm_head.weight
        if args.teacher == "full":
            loss = torch_fused.linear_distill(h_s, w_s, h_t, teacher.lm_head.weight, beta=beta, temperature=T,
                                              labels=labels, shift=True, reduction="token-mean")
        else:
            with torch.no_grad():  # what an inference server returns: the top-k ids and their log-probs
                lt_full = (h_t[:, :-1] @ teacher.lm_head.weight.t()).float().div(T).log_softmax(-1)
                topk_lp, topk_ids = lt_full.topk(args.k, -1)
            loss = torch_fused.linear_distill(h_s, w_s, teacher_topk_ids=topk_ids, teacher_topk_logprobs=topk_lp,
                                              tail="bucket", beta=beta, temperature=T, labels=labels, shift=True,
                                              reduction="token-mean")
        if step == 0:
            hist["check"] = check_against_materialized(args, student, teacher, h_s, h_t, labels, loss,
                                                       None if args.teacher == "full" else (topk_ids, topk_lp))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hist["loss"].append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:3d}  divergence {loss.item():.4f} nats per token")
    check(hist, TOL[args.dtype])
    return hist


def check_against_materialized(args, student, teacher, h_s, h_t, labels, loss, topk):
    """Relative errors of the fused loss and its gradients (student hidden states, lm_head) against
    the materialized formula, in fp32 from the same inputs."""
    hs, ws = h_s.detach().float().requires_grad_(), student.lm_head.weight.detach().float().requires_grad_()
    zs = (hs[:, :-1] @ ws.t()) / args.temperature
    if topk is None:
        lt = ((h_t[:, :-1].float() @ teacher.lm_head.weight.float().t()) / args.temperature).log_softmax(-1)
        per_token = divergence_materialized(zs, lt, args.beta)
    else:
        per_token = topk_materialized(zs, topk[0], topk[1], args.beta)
    keep = labels != -100
    ref = (per_token * keep).sum() / keep.sum().clamp_min(1)
    ref_dh, ref_dw = torch.autograd.grad(ref, (hs, ws))
    dh, dw = torch.autograd.grad(loss, (h_s, student.lm_head.weight), retain_graph=True)
    errs = {"loss": rel_err(loss.detach(), ref.detach()), "d_hidden": rel_err(dh, ref_dh),
            "d_weight": rel_err(dw, ref_dw)}
    print("fused vs materialized relative errors: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return errs


def check(hist, tol):
    """Raises unless every loss is finite, the first step agreed with the materialized formula and
    the divergence fell (the mean of the last quarter of the steps below the first quarter's)."""
    bad = [i for i, x in enumerate(hist["loss"]) if not math.isfinite(x)]
    if bad:
        raise RuntimeError(f"non-finite loss at steps {bad}")
    far = {k: v for k, v in hist["check"].items() if not v <= tol}
    if far:
        raise RuntimeError(f"fused and materialized differ at the first step (relative errors {far}, allowed {tol})")
    q = max(1, len(hist["loss"]) // 4)
    first, last = sum(hist["loss"][:q]) / q, sum(hist["loss"][-q:]) / q
    if len(hist["loss"]) >= 4 and not last < first:
        raise RuntimeError(f"the divergence did not fall: {first:.4f} over the first steps, {last:.4f} over the last")


if __name__ == "__main__":
    main()
