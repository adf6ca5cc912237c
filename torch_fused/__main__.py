"""``python -m torch_fused``: self-check and demo on whatever device is present.

For each shipped op: run it at a realistic small shape, compare with a float64 reference, time
it, and count graph breaks when it is traced by ``torch.compile(fullgraph=True)``. Then run a
few steps of a tiny compiled policy-gradient training loop that uses the ops forward and
backward. Prints a table; exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import torch_fused


def _time_ms(fn, device, iters=5) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def _graph_breaks(fn, *args) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


def _checks(device):
    g = torch.Generator().manual_seed(0)
    b, l, v = (4, 512, 32000) if device.type == "cuda" else (2, 64, 4096)
    full = (torch.randn(b, l + 1, v, generator=g) * 3).to(device, torch.bfloat16)
    x = full[:, :-1]  # the strided view RL losses use
    idx = torch.randint(0, v, (b, l), generator=g).to(device)
    x64 = x.double()
    lsm = torch.log_softmax(x64, -1)
    ref_lp = lsm.gather(-1, idx[..., None]).squeeze(-1)
    ref_h = -(lsm.exp() * lsm).sum(-1)

    rows = []

    def add(name, fn, ref, args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        err = max((o.double() - r).abs().max().item() for o, r in zip(outs, refs))
        rows.append((name, _time_ms(lambda: fn(*args), device), err, _graph_breaks(fn, *args)))

    add("selective_log_softmax", torch_fused.selective_log_softmax, ref_lp, (x, idx))
    add("entropy_from_logits", torch_fused.entropy_from_logits, ref_h, (x,))
    add("logprobs_and_entropy", torch_fused.logprobs_and_entropy, (ref_lp, ref_h), (x, idx))

    t, k, h = (4096, 4, 1024) if device.type == "cuda" else (256, 4, 256)
    hs = torch.randn(t, k, h, generator=g).to(device, torch.bfloat16)
    keep = (torch.rand(t, k, 1, generator=g) > 0.3).to(device)
    w = torch.rand(t, k, 1, generator=g).to(device)
    mask = keep.expand(t, k, h)  # broadcast view, never materialized
    ref_mr = torch.where(mask, hs.double() * w.double(), 0).sum(1)
    add("mask_reduce", lambda a, m, s: torch_fused.mask_reduce(a, 1, m, s, out_dtype=torch.float32),
        ref_mr, (hs, mask, w))

    # sinkgd_step: one in-place update vs the float64 formula (docs/SINKGD.md), L = 5
    mm, nn = (1024, 4096) if device.type == "cuda" else (256, 512)
    w0 = torch.randn(mm, nn, generator=g).to(device, torch.bfloat16)
    gr = (torch.randn(mm, nn, generator=g) * 1e-3).to(device, torch.bfloat16)
    x = gr.double()
    for _ in range(5):
        x = nn**0.5 * x / x.norm(dim=1, keepdim=True).clamp_min(1e-8)
        x = mm**0.5 * x / x.norm(dim=0, keepdim=True).clamp_min(1e-8)
    ref_w = (w0.double() - 1e-2 * 0.05 * x).to(torch.bfloat16).double()
    lr = torch.tensor(1e-2)
    seed = torch.tensor(0.0)

    def sink(wt, gt):
        torch.ops.fused.sinkgd_step([wt], [gt], [], lr, 0.05, 0.0, 1e-8, 5, False, "unit", 1, None, 1.0, False, seed)
        return wt

    # error in units of the bf16 step of each element (the update is rounded once to bf16)
    out = sink(w0.clone(), gr)
    ulp = torch.ldexp(torch.ones_like(ref_w), torch.frexp(ref_w)[1] - 8)
    err = ((out.double() - ref_w).abs() / ulp).max().item() * 2**-8
    rows.append(("sinkgd_step", _time_ms(lambda: sink(w0.clone(), gr), device), err,
                 _graph_breaks(sink, w0.clone(), gr)))
    return rows


def _train_demo(device, steps=4):
    """A tiny policy-gradient step, compiled with fullgraph=True: policy logits from a linear
    head, per-token log-probs and entropy from one fused op, a token-mean loss under a mask."""
    torch.manual_seed(0)
    hidden, vocab, b, l = 64, 512, 4, 33
    head = torch.nn.Linear(hidden, vocab, device=device)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)

    def loss_fn(h, tokens, adv, mask):
        logits = head(h)  # [B, L + 1, V]
        logp, ent = torch_fused.logprobs_and_entropy(logits[:, :-1], tokens)
        pg = -adv[:, None] * logp - 0.01 * ent
        return torch_fused.aggregate_loss(pg, mask, "token-mean")

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(b, l + 1, hidden, generator=g).to(device)
    tokens = torch.randint(0, vocab, (b, l), generator=g).to(device)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device=device)
    mask = (torch.rand(b, l, generator=g) > 0.2).to(device)
    losses = []
    for i in range(steps):
        if i == 1:  # time the steps after the first (which compiles)
            t0 = time.perf_counter()
        opt.zero_grad()
        loss = compiled(h, tokens, adv, mask)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ms = (time.perf_counter() - t0) / (steps - 1) * 1e3
    ref = loss_fn(h, tokens, adv, mask).item()  # eager, same parameters
    now = compiled(h, tokens, adv, mask).item()
    breaks = _graph_breaks(loss_fn, h, tokens, adv, mask)
    return losses, ms, abs(now - ref), breaks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_fused")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"torch-fused {torch_fused.__version__} | torch {torch.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))
    from torch_fused._library import INTERPRET

    path = "Triton kernels" if device.type == "cuda" or INTERPRET else "PyTorch reference (CPU)"
    print(f"implementation: {path}\n")
    rows = _checks(device)
    losses, ms, err, breaks = _train_demo(device)
    rows.append(("compiled PG train step", ms, err, breaks))  # time: a step after compiling
    # (max err column: |compiled - eager| for the train step; for sinkgd_step, in bf16 steps x 2^-8)
    print(f"{'op':26s} {'device':7s} {'time ms':>9s} {'max err vs ref':>15s} {'graph breaks':>13s}")
    for name, t, e, gb in rows:
        print(f"{name:26s} {device.type:7s} {t:9.3f} {e:15.2e} {gb:13d}")
    print(f"\ntrain-step losses: {', '.join(f'{x:.4f}' for x in losses)}")
    ok = all(gb == 0 for *_, gb in rows)
    # log-prob ops and mask_reduce: fp32 outputs; sinkgd_step: at most one bf16 step; the
    # compiled training step vs eager
    ok &= all(e < 5e-3 for _, _, e, _ in rows[:4]) and rows[4][2] <= 2**-8 and err < 1e-3
    ok &= losses[-1] < losses[0]
    print("self-check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
