"""``python -m torch_fused``: self-check and demo on whatever device is present.

For each shipped op (the distillation ops as the generalized JSD): run it at a realistic small shape, compare with a float64 reference, time
it, and count graph breaks when it is traced by ``torch.compile(fullgraph=True)``. Then run a
few steps of a tiny compiled policy-gradient (PG) training loop that uses the ops forward and
backward. Prints one row per check: what is measured, the value, the bound it must meet, and
PASS or FAIL; exits non-zero if any check fails.
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


def _ref_jsd(zs, zt, beta=0.5):
    """The generalized JSD per row of float64 logits (TRL's definition)."""
    ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    lm = torch.logaddexp(ls + torch.log1p(torch.tensor(-beta)).item(), lt + torch.log(torch.tensor(beta)).item())
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def _checks(device):
    """Rows of (check, time ms, measure, value, bound, graph breaks)."""
    g = torch.Generator().manual_seed(0)
    b, l, v = (4, 512, 32000) if device.type == "cuda" else (2, 64, 4096)
    full = (torch.randn(b, l + 1, v, generator=g) * 3).to(device, torch.bfloat16)  # a model's [B, L+1, V]
    idx = torch.randint(0, v, (b, l), generator=g).to(device)
    x64 = full[:, :-1].double()
    lsm = torch.log_softmax(x64, -1)
    ref_lp = lsm.gather(-1, idx[..., None]).squeeze(-1)
    ref_h = -(lsm.exp() * lsm).sum(-1)

    rows = []
    nats = "max |err| vs float64, nats"

    def add(name, fn, ref, args, measure=nats, bound=1e-4):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        err = max((o.double() - r).abs().max().item() for o, r in zip(outs, refs))
        rows.append((name, _time_ms(lambda: fn(*args), device), measure, err, bound, _graph_breaks(fn, *args)))

    # shift=True: the op reads positions 0..L-1 of the model's logits in place
    add("selective_log_softmax", lambda x, i: torch_fused.selective_log_softmax(x, i, shift=True), ref_lp,
        (full, idx))
    add("entropy_from_logits", lambda x: torch_fused.entropy_from_logits(x, shift=True), ref_h, (full,))
    add("logprobs_and_entropy", lambda x, i: torch_fused.logprobs_and_entropy(x, i, shift=True),
        (ref_lp, ref_h), (full, idx))

    # the fused lm_head from hidden states [B, L+1, H] and a weight [V, H], shift=True
    hd = 512 if device.type == "cuda" else 64
    hid = torch.randn(b, l + 1, hd, generator=g).to(device, torch.bfloat16)
    wt = (torch.randn(v, hd, generator=g) / hd**0.5 * 2).to(device, torch.bfloat16)
    zl = torch.log_softmax(hid[:, :-1].double() @ wt.double().t(), -1)
    ref_hl = zl.gather(-1, idx[..., None]).squeeze(-1)
    ref_hh = -(zl.exp() * zl).sum(-1)
    del zl
    # fp32 GEMM accumulation over H terms
    add("linear_logprobs_and_entropy",
        lambda a, w_, i: torch_fused.linear_logprobs_and_entropy(a, w_, i, shift=True), (ref_hl, ref_hh),
        (hid, wt, idx), nats, 1e-3)

    # distillation (beta 0.5: the generalized JSD) against a teacher, from the logits and from both
    # models' heads (the teacher twice as wide), shift=True; reduction "none" (per token)
    teacher = (torch.randn(b, l + 1, v, generator=g) * 3).to(device, torch.bfloat16)
    add("distill", lambda s_, t_: torch_fused.distill(s_, t_, shift=True),
        _ref_jsd(x64, teacher[:, :-1].double()), (full, teacher), nats, 1e-5)
    t_hid = torch.randn(b, l + 1, 2 * hd, generator=g).to(device, torch.bfloat16)
    t_wt = (torch.randn(v, 2 * hd, generator=g) / (2 * hd) ** 0.5 * 2).to(device, torch.bfloat16)
    ref_jh = _ref_jsd(hid[:, :-1].double() @ wt.double().t(), t_hid[:, :-1].double() @ t_wt.double().t())
    # fp32 GEMM accumulation over H terms, as the fused lm_head
    add("linear_distill", lambda a, w_, c, d: torch_fused.linear_distill(a, w_, c, d, shift=True), ref_jh,
        (hid, wt, t_hid, t_wt), nats, 1e-3)
    del ref_jh

    t, k, h = (4096, 4, 1024) if device.type == "cuda" else (256, 4, 256)
    hs = torch.randn(t, k, h, generator=g).to(device, torch.bfloat16)
    keep = (torch.rand(t, k, 1, generator=g) > 0.3).to(device)
    w = torch.rand(t, k, 1, generator=g).to(device)
    mask = keep.expand(t, k, h)  # broadcast view, never materialized
    ref_mr = torch.where(mask, hs.double() * w.double(), 0).sum(1)
    # fp32 accumulation of k products: relative to the largest |output|
    add("mask_reduce", lambda a, m, s: torch_fused.mask_reduce(a, 1, m, s, out_dtype=torch.float32)
        / ref_mr.abs().max(), ref_mr / ref_mr.abs().max(), (hs, mask, w), "max |err| / max |y|", 1e-5)

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
        torch_fused.sinkgd_step([wt], [gt], lr=lr, lr_scale=0.05, sinkhorn_iters=5, eps=1e-8, step=seed)
        return wt

    # error in units of the bf16 step of each element (the update is rounded once to bf16)
    out = sink(w0.clone(), gr)
    ulp = torch.ldexp(torch.ones_like(ref_w), torch.frexp(ref_w)[1] - 8)
    err = ((out.double() - ref_w).abs() / ulp).max().item()
    rows.append(("sinkgd_step", _time_ms(lambda: sink(w0.clone(), gr), device), "max |err| in bf16 ulps", err, 1.0,
                 _graph_breaks(sink, w0.clone(), gr)))
    return rows


def _train_demo(device, steps=4):
    """A tiny policy-gradient (PG) step, compiled with fullgraph=True: policy logits from a linear
    head, per-token log-probs and entropy from one fused op (shift=True on the [B, L+1, V]
    logits), a token-mean loss under a float mask, as GRPO loops pass it."""
    torch.manual_seed(0)
    hidden, vocab, b, l = 64, 512, 4, 33
    head = torch.nn.Linear(hidden, vocab, device=device)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)

    def loss_fn(h, tokens, adv, mask):
        logits = head(h)  # [B, L + 1, V]
        logp, ent = torch_fused.logprobs_and_entropy(logits, tokens, shift=True)
        pg = -adv[:, None] * logp - 0.01 * ent
        return torch_fused.aggregate_loss(pg, mask, "token-mean")

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(b, l + 1, hidden, generator=g).to(device)
    tokens = torch.randint(0, vocab, (b, l), generator=g).to(device)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device=device)
    mask = (torch.rand(b, l, generator=g) > 0.2).float().to(device)
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
    ap = argparse.ArgumentParser(prog="python -m torch_fused", description=__doc__.split("\n\n")[1].replace("\n", " "),
                                 epilog="Benchmarks: python -m torch_fused.bench --help")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="the device to check (default: %(default)s, the Triton kernels on CUDA, the "
                         "plain-PyTorch implementations on CPU)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"torch-fused {torch_fused.__version__} | torch {torch.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))
    from torch_fused._library import INTERPRET

    path = "Triton kernels" if device.type == "cuda" or INTERPRET else "PyTorch reference (CPU)"
    print(f"implementation: {path}\n")
    rows = _checks(device)
    losses, ms, err, breaks = _train_demo(device)
    rows.append(("compiled PG train step", ms, "|compiled - eager| loss", err, 1e-3, breaks))
    rows.append(("  ...loss decreases", float("nan"), "last loss - first loss", losses[-1] - losses[0], 0.0, 0))
    print(f"{'check':28s} {'time ms':>9s}  {'measure':28s} {'value':>10s} {'bound':>8s} {'graph breaks':>12s}  result")
    ok = True
    for name, t, measure, value, bound, gb in rows:
        good = value <= bound and gb == 0 if name != "  ...loss decreases" else value < bound
        ok &= good
        tm = "" if t != t else f"{t:9.3f}"
        print(f"{name:28s} {tm:>9s}  {measure:28s} {value:10.2e} {bound:8.0e} {gb:12d}  {'PASS' if good else 'FAIL'}")
    print("\ntime: one call after a warm-up (train step: one step after compiling); graph breaks must be 0")
    print(f"train-step losses: {', '.join(f'{x:.4f}' for x in losses)}")
    print("self-check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
