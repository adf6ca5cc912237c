"""One GRPO-style training step of a decoder-only transformer, end to end, three ways.

The model is written here in plain PyTorch (RMSNorm, rotary positions, SDPA causal attention,
SwiGLU MLP, an untied lm_head; bf16 parameters). One step is: forward of the trunk, per-token
log-probs of each sequence's next tokens (positions 0..S-2 predicting tokens 1..S-1) and their
entropy, the PPO-clipped GRPO objective against detached old log-probs (on-policy) with one
advantage per sequence and an entropy bonus, aggregated per token under a completion mask
(sum over the mask / mask count), backward, optimizer step, ``zero_grad(set_to_none=True)``.

Paths (each eager, and compiled: every transformer block and the head + loss compiled with
``torch.compile(fullgraph=True)``; the embedding lookup and the optimizer step stay eager):
  materialized  logits = h @ W.T over all S positions, ``logits[:, :-1]``, fp32 log_softmax,
                gather, entropy from the softmax; torch.optim.AdamW(fused=True)
  trl           TRL's chunked lm_head ``trl.kernels.ChunkedLogProbFunction`` as TRL's trainers
                call it (on a Triton device only the completion positions are scored);
                torch.optim.AdamW(fused=True). Skipped, with the reason recorded, without trl.
  torch_fused   ``torch_fused.linear_logprobs_and_entropy(hidden, lm_head.weight, tokens,
                shift=True)``, ``torch_fused.aggregate_loss``; ``torch_fused.optim.SinkGD`` for the
                hidden matrices (``sinkgd_param_groups``: AdamW for embeddings, head and norms)

Reported: step time (CUDA events around whole steps, median after warm-up), tokens/s, peak
memory (``max_memory_allocated`` over one step, absolute, and the model + optimizer-state
memory held between steps) at one micro-batch for all paths; then, eager only, the largest
micro-batch each path fits (doubling, then bisection, catching OutOfMemoryError) and tokens/s
there. A path that fails is recorded with its error; the others still run.

``python -m torch_fused.bench.step --device cpu --tiny`` runs the same code with a tiny model on
CPU (wall-clock timing, no memory figures): a check of the code paths, not a benchmark.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torch_fused
from torch_fused.optim import SinkGD, sinkgd_param_groups

from . import common

PATHS = ("materialized", "trl", "torch_fused")
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass
class Config:
    vocab: int = 151936  # Qwen2/2.5's vocabulary
    layers: int = 8
    hidden: int = 2048
    heads: int = 16
    intermediate: int = 5632
    seq: int = 4096  # tokens per sequence (S); S - 1 of them are predicted
    prompt: int = 256  # leading tokens outside the completion mask
    batch: int = 4  # the micro-batch at which every path is compared
    dtype: str = "bfloat16"
    rope_theta: float = 1e6
    clip_eps: float = 0.2
    entropy_coef: float = 1e-3
    lr: float = 1e-6
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    checkpoint: bool = False  # activation checkpointing per block (each block's forward rerun in the backward)
    stochastic_round: bool = False  # SinkGD's bf16 parameter updates rounded stochastically (torch_fused path)

    def check(self) -> None:
        for name in ("vocab", "layers", "hidden", "heads", "intermediate", "seq", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.seq < 2:
            raise ValueError(f"seq: expected >= 2 (one token predicted from the one before), got {self.seq}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden: expected a multiple of heads ({self.heads}) with an even head size, "
                             f"got {self.hidden}")
        if self.kv_heads < 0 or self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"kv_heads: expected 0 (as many as heads) or a divisor of heads ({self.heads}), "
                             f"got {self.kv_heads}")
        if not 0 <= self.prompt < self.seq:
            raise ValueError(f"prompt: expected 0 <= prompt < seq ({self.seq}), got {self.prompt}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {self.dtype!r}")


FULL = Config()
QUICK = Config(layers=2, seq=2048, batch=4)
TINY = Config(vocab=512, layers=2, hidden=64, heads=4, intermediate=128, seq=33, prompt=8, batch=2,
              dtype="float32")
# Llama-3-8B's shape (32 layers, hidden 4096, 32 query and 8 key/value heads, MLP 14336, vocab
# 128256, rope theta 5e5), bf16 parameters, full-parameter training with activation checkpointing
# per block; SinkGD with stochastic rounding on the torch_fused path (python -m torch_fused.bench step_8b)
LLAMA3_8B = Config(vocab=128256, layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, seq=4096,
                   prompt=256, batch=1, rope_theta=5e5, checkpoint=True, stochastic_round=True)
PRESETS = {"default": FULL, "quick": QUICK, "tiny": TINY, "llama3-8b": LLAMA3_8B}


# ---------------------------------------------------------------------------------------------
# the model


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, **kw):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **kw))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(seq, head_dim, theta, device, dtype):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)  # [S, D/2]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    def __init__(self, cfg: Config, **kw):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.kv_heads = cfg.kv_heads or cfg.heads
        self.attn_norm = RMSNorm(cfg.hidden, **kw)
        self.qkv = nn.Linear(cfg.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False, **kw)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False, **kw)
        self.mlp_norm = RMSNorm(cfg.hidden, **kw)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False, **kw)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False, **kw)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], 2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads (kv_heads), S, head_dim]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:  # grouped-query attention: each key/value head serves heads / kv_heads queries
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, 1) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    """Decoder-only transformer; ``trunk(ids)`` gives the last hidden states [B, S, H] (after the
    final norm), the lm_head is applied by the loss of each path."""

    def __init__(self, cfg: Config, device):
        super().__init__()
        kw = dict(device=device, dtype=getattr(torch, cfg.dtype))
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, **kw)
        self.layers = nn.ModuleList(Block(cfg, **kw) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, **kw)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, **kw)  # untied
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, device=device, generator=g) * std)
        cos, sin = rope_tables(cfg.seq, cfg.hidden // cfg.heads, cfg.rope_theta, device, kw["dtype"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def trunk(self, ids, block_fn=None):
        s = ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed(ids)
        for blk in self.layers:
            x = blk(x, cos, sin) if block_fn is None else block_fn(blk, x, cos, sin)
        return x


def _block_call(blk, x, cos, sin):
    return blk(x, cos, sin)


def checkpointed(block_fn):
    """block_fn with activation checkpointing: only the block's input is kept for the backward,
    which reruns its forward."""
    from torch.utils.checkpoint import checkpoint

    def call(blk, x, cos, sin):
        return checkpoint(block_fn, blk, x, cos, sin, use_reentrant=False)

    return call


# ---------------------------------------------------------------------------------------------
# the GRPO objective and the three heads


def grpo_per_token(logp, ent, adv, clip_eps, entropy_coef):
    """PPO-clipped policy loss per token against detached old log-probs (on-policy: the ratio is
    1 with gradient d logp), minus an entropy bonus."""
    ratio = torch.exp(logp - logp.detach())
    a = adv[:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    return pg - entropy_coef * ent


def _token_mean(x, maskf):
    return (x * maskf).sum() / maskf.sum().clamp_min(1)


def head_materialized(model, x, ids, adv, mask, clip_eps, entropy_coef):
    h = model.norm(x)
    logits = model.lm_head(h)  # [B, S, V], the model's dtype
    logp_all = logits[:, :-1].float().log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    maskf = mask.float()
    loss = _token_mean(grpo_per_token(logp, ent, adv, clip_eps, entropy_coef), maskf)
    return loss, _token_mean(ent.detach(), maskf)


def head_torch_fused(model, x, ids, adv, mask, clip_eps, entropy_coef):
    h = model.norm(x)
    logp, ent = torch_fused.linear_logprobs_and_entropy(h, model.lm_head.weight, ids[:, 1:], shift=True)
    loss = torch_fused.aggregate_loss(grpo_per_token(logp, ent, adv, clip_eps, entropy_coef), mask, "token-mean")
    return loss, torch_fused.masked_mean(ent.detach(), mask)


def trl_head():
    """(the head function, TRL's version, its chunk size), or the import's error. The backward of
    TRL's ChunkedLogProbFunction imports trl.trainer.utils (which needs datasets, accelerate,
    pandas): imported here so a missing dependency shows before any timing."""
    import trl
    import trl.trainer.utils as trl_utils
    from trl.kernels import ChunkedLogProbFunction
    from trl.kernels.chunked_logprob import _use_triton

    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)

    def head_trl(model, x, ids, adv, mask, clip_eps, entropy_coef):
        # as TRL's add_fused_lm_head: hidden[:, :-1] scores tokens[:, 1:]; on a Triton device only
        # the completion positions are scored, then scattered back
        h = model.norm(x)[:, :-1]
        tgt = ids[:, 1:]
        w = model.lm_head.weight
        if _use_triton(h.device):
            lp, ent, *_ = ChunkedLogProbFunction.apply(h[mask], w, None, tgt[mask], 1.0, chunk, None, 1.0,
                                                       ("entropy",))
            logp = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
            ent = ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        else:
            lp, ent, *_ = ChunkedLogProbFunction.apply(h.reshape(-1, h.shape[-1]), w, None, tgt.reshape(-1), 1.0,
                                                       chunk, None, 1.0, ("entropy",))
            logp = lp.view(mask.shape).masked_fill(~mask, 0)
            ent = ent.view(mask.shape).masked_fill(~mask, 0)
        maskf = mask.float()
        loss = _token_mean(grpo_per_token(logp, ent, adv, clip_eps, entropy_coef), maskf)
        return loss, _token_mean(ent.detach(), maskf)

    return head_trl, trl.__version__, chunk


def make_optimizer(path, model, lr, stochastic_round=False):
    if path == "torch_fused":
        return SinkGD(sinkgd_param_groups(model, lr=lr), lr=lr, stochastic_round=stochastic_round)
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)


def make_batch(cfg: Config, b: int, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (b, cfg.seq), device=device, generator=g)
    adv = torch.randn(b, device=device, generator=g)
    pos = torch.arange(cfg.seq - 1, device=device)
    mask = (pos >= max(cfg.prompt - 1, 0)).expand(b, -1).contiguous()  # predicts a completion token
    return ids, adv, mask


# ---------------------------------------------------------------------------------------------
# measuring


class Stepper:
    """One path in one mode: ``step(batch)`` runs a whole training step, returns (loss, entropy)."""

    def __init__(self, path, mode, model, cfg, head, compile_state):
        self.path, self.mode, self.model, self.cfg = path, mode, model, cfg
        self.opt = make_optimizer(path, model, cfg.lr, cfg.stochastic_round)
        self.head, self.raw_head, self.block_fn = head, head, None
        self.note = ""
        if mode == "compiled":
            self.block_fn = compile_state["block"]
            self.head = torch.compile(head, fullgraph=True, dynamic=False)
        if cfg.checkpoint:
            self.block_fn = checkpointed(self.block_fn or _block_call)

    def step(self, batch):
        ids, adv, mask = batch
        x = self.model.trunk(ids, self.block_fn)
        loss, ent = self.head(self.model, x, ids, adv, mask, self.cfg.clip_eps, self.cfg.entropy_coef)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), ent

    def first_step(self, batch):
        """The first call (compilation, optimizer state); a compiled head that cannot be traced
        whole falls back to torch.compile without fullgraph, noted."""
        try:
            return self.step(batch)
        except Exception as e:  # noqa: BLE001
            if self.mode != "compiled" or isinstance(e, OOM):
                raise
            why = _first_line(e)
        # the failed attempt's frames (its trunk output and saved activations) sit in a reference
        # cycle with the exception: freed here, before this path's memory is measured
        gc.collect()
        torch.cuda.empty_cache()
        self.model.zero_grad(set_to_none=True)
        self.head = torch.compile(self.raw_head, fullgraph=False, dynamic=False)
        self.note = f"head+loss not traceable with fullgraph=True ({why}): compiled with graph breaks"
        return self.step(batch)


def _first_line(e: BaseException, n=160) -> str:
    s = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return s[:n]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(stepper, batch, device, warmup, reps):
    """(median ms, losses, entropies) over reps steps after warmup steps; an entropy is None
    where the stepper returns none (the distillation step, bench/distill_step.py)."""
    for _ in range(warmup):
        stepper.step(batch)
    _sync(device)
    ms, losses, ents = [], [], []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            loss, ent = stepper.step(batch)
            e.record()
            torch.cuda.synchronize()
            ms.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            loss, ent = stepper.step(batch)
            ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
        ents.append(None if ent is None else float(ent))
    return statistics.median(ms), losses, ents


def peak_of_step(stepper, batch, device):
    """(peak MiB over one step, MiB held before it: parameters + optimizer state) on CUDA."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    stepper.step(batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20, base / 2**20


def fits(stepper, cfg, b, device) -> bool:
    """Whether one training step at micro-batch b runs without running out of device memory."""
    ok = True
    try:
        batch = make_batch(cfg, b, device, seed=b)
        stepper.step(batch)
        _sync(device)
    except OOM:
        ok = False
    batch = None
    stepper.model.zero_grad(set_to_none=True)
    _free(device)
    return ok


def largest_batch(stepper, cfg, device, start, cap, bisect=True, deadline=math.inf):
    """(largest micro-batch found, tries, cut short): doubling from start, then bisection down to
    an eighth of the lower end (1 for small batches); capped at cap. Past the deadline
    (time.perf_counter()) no new try starts: the largest batch that fitted so far is returned."""
    tries = []
    lo, hi, b = 0, None, start
    while b <= cap:
        if time.perf_counter() > deadline and lo:
            return lo, tries, True
        ok = fits(stepper, cfg, b, device)
        tries.append((b, ok))
        if not ok:
            hi = b
            break
        lo, b = b, b * 2
    if hi is None or not bisect:
        return lo, tries, False
    while hi - lo > max(1, lo // 8):
        if time.perf_counter() > deadline and lo:
            return lo, tries, True
        mid = (lo + hi) // 2
        ok = fits(stepper, cfg, mid, device)
        tries.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, tries, False


# ---------------------------------------------------------------------------------------------
# the suite


def measure(cfg: Config, device, *, modes=("eager", "compiled"), paths=PATHS, warmup=2, reps=5,
            max_batch=True, max_batch_cap=256, bisect=True, budget_s=math.inf, log=print) -> dict:
    """Run every path in every mode at cfg.batch, then the largest-batch search (eager), and
    return the results as a dict (what step.json holds under extra["step"]). The search of each
    path stops starting new tries once its share of what is left of budget_s (seconds since the
    start) is spent, and says so."""
    cfg.check()
    device = torch.device(device)
    for m in modes:
        if m not in ("eager", "compiled"):
            raise ValueError(f"modes: expected 'eager' and/or 'compiled', got {m!r}")
    for p in paths:
        if p not in PATHS:
            raise ValueError(f"paths: expected names from {PATHS}, got {p!r}")
    t_start = time.perf_counter()
    res = dict(config=asdict(cfg), device=str(device), modes=list(modes), equal_batch={}, largest_batch={},
               skipped={}, errors={}, bars={}, versions={"torch": torch.__version__})
    heads = {"materialized": head_materialized, "torch_fused": head_torch_fused}
    if "trl" in paths:
        try:
            heads["trl"], res["versions"]["trl"], res["trl_chunk_size"] = trl_head()
        except Exception as e:  # noqa: BLE001  (ImportError, or a TRL that does not fit this torch)
            res["skipped"]["trl"] = f"trl not usable ({_first_line(e)}); pip install -e '.[trl]'"
            log(f"trl: skipped, {res['skipped']['trl']}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = Model(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    res["params"] = n_params
    res["param_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    log(f"model: {n_params / 1e6:.1f}M parameters ({cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, "
        f"{cfg.dtype}); micro-batch {cfg.batch} x {cfg.seq} tokens")
    compile_state = {}
    if "compiled" in modes:
        # one compiled block serves every layer (the parameters are graph inputs); room for more
        # entries anyway, so a guard failure recompiles instead of falling back to eager
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
        compile_state["block"] = torch.compile(_block_call, fullgraph=True, dynamic=False)
    batch = make_batch(cfg, cfg.batch, device)
    tokens = cfg.batch * cfg.seq
    run_paths = [p for p in paths if p in heads]
    for mode in modes:
        for path in run_paths:
            key = f"{path} {mode}"
            stepper = None
            try:
                stepper = Stepper(path, mode, model, cfg, heads[path], compile_state)
                _sync(device)
                t0 = time.perf_counter()
                stepper.first_step(batch)
                _sync(device)
                first_s = time.perf_counter() - t0
                ms, losses, ents = time_steps(stepper, batch, device, max(warmup - 1, 0), reps)
                peak, base = peak_of_step(stepper, batch, device)
                if not all(math.isfinite(v) for v in losses + ents):
                    raise FloatingPointError(f"non-finite loss or entropy: {losses}, {ents}")
                r = dict(ms=ms, tokens_per_s=tokens / (ms * 1e-3), peak_mib=peak, held_mib=base,
                         first_step_s=first_s, loss=losses[-1], entropy=ents[-1], note=stepper.note)
                res["equal_batch"][key] = r
                pk = "" if peak is None else f"  peak {peak:8.0f} MiB (held between steps {base:.0f})"
                log(f"B{cfg.batch:<3d} {key:24s} {ms:9.2f} ms  {r['tokens_per_s']:10.0f} tok/s{pk}  "
                    f"first step {first_s:.1f} s  entropy {ents[-1]:.3f}" + (f"  [{stepper.note}]" if stepper.note else ""))
            except Exception as e:  # noqa: BLE001  (one path failing must not stop the others)
                res["errors"][key] = _first_line(e, 400)
                log(f"B{cfg.batch:<3d} {key:24s} FAILED: {_first_line(e, 400)}")
                log("".join(traceback.format_exception(e))[-1500:])
            finally:
                if stepper is not None:
                    stepper.opt = None
                stepper = None
                model.zero_grad(set_to_none=True)
                _free(device)
    if max_batch:
        searched = [p for p in run_paths if f"{p} eager" in res["equal_batch"]]
        for i, path in enumerate(searched):
            key = f"{path} eager"
            stepper = None
            left = budget_s - (time.perf_counter() - t_start)
            deadline = time.perf_counter() + max(left, 0.0) / (len(searched) - i) * 0.6  # 0.4: timing there
            try:
                stepper = Stepper(path, "eager", model, cfg, heads[path], compile_state)
                stepper.step(make_batch(cfg, 1, device))  # the optimizer state, before the search
                model.zero_grad(set_to_none=True)
                _free(device)
                b, tries, cut = largest_batch(stepper, cfg, device, cfg.batch, max_batch_cap, bisect, deadline)
                r = dict(batch=b, tries=tries, capped=b >= max_batch_cap, cut_short=cut)
                while b > 0:
                    try:
                        big = make_batch(cfg, b, device)
                        ms, _, _ = time_steps(stepper, big, device, 1, reps)  # the bars compare these
                        r.update(batch=b, ms=ms, tokens_per_s=b * cfg.seq / (ms * 1e-3))
                        break
                    except OOM:  # fragmentation after the search: one step down
                        big = None
                        model.zero_grad(set_to_none=True)
                        _free(device)
                        b = b - max(1, b // 8)
                        r["note"] = "timed below the largest batch found (out of memory when timing it)"
                big = None
                res["largest_batch"][key] = r
                log(f"largest micro-batch {key:22s} {r['batch']:4d}" + (" (cap)" if r["capped"] else "") +
                    (" (search cut short by the time budget)" if cut else "") +
                    (f"  {r['ms']:9.1f} ms  {r['tokens_per_s']:10.0f} tok/s" if "ms" in r else "") +
                    f"  tries {tries}")
            except Exception as e:  # noqa: BLE001
                res["errors"][f"{key} largest batch"] = _first_line(e, 400)
                log(f"largest micro-batch {key}: FAILED: {_first_line(e, 400)}")
            finally:
                if stepper is not None:
                    stepper.opt = None
                stepper = None
                model.zero_grad(set_to_none=True)
                _free(device)
    res["bars"] = bars(res, modes)
    res["wall_s"] = time.perf_counter() - t_start
    for name, b in res["bars"].items():
        log(f"{b['verdict']:4s}  {name}: {b['detail']}")
    return res


def bars(res, modes) -> dict:
    """PASS/FAIL (or n/a, with the reason) of the suite's targets: at the equal micro-batch,
    torch_fused's peak memory <= 0.7x the materialized path's and <= TRL's; at each path's
    largest micro-batch (eager), torch_fused's tokens/s >= both baselines'."""
    out = {}

    def verdict(ok_list):
        return "PASS" if all(ok_list) else "FAIL"

    def missing(key, table):
        if key in table:
            return None
        path = key.split()[0]
        return res["skipped"].get(path) or res["errors"].get(key) or res["errors"].get(f"{key} largest batch") \
            or "not measured"

    eq = res["equal_batch"]
    for mode in modes:
        ours = f"torch_fused {mode}"
        for base, factor in (("materialized", 0.7), ("trl", 1.0)):
            bk = f"{base} {mode}"
            name = f"peak memory at micro-batch {res['config']['batch']}, {mode}: torch_fused <= {factor}x {base}"
            why = missing(ours, eq) or missing(bk, eq)
            if why is None and eq[ours]["peak_mib"] is None:
                why = "no memory figures on this device"
            if why:
                out[name] = dict(verdict="n/a", detail=why)
                continue
            a, b = eq[ours]["peak_mib"], eq[bk]["peak_mib"]
            out[name] = dict(verdict=verdict([a <= factor * b]), ours_mib=a, base_mib=b, ratio=a / b,
                             detail=f"{a:.0f} MiB vs {b:.0f} MiB ({a / b:.3f}x)")
    lb = res["largest_batch"]
    ours = "torch_fused eager"
    for base in ("materialized", "trl"):
        bk = f"{base} eager"
        name = f"tokens/s at each path's largest micro-batch, eager: torch_fused >= {base}"
        why = missing(ours, lb) or missing(bk, lb)
        if why is None and ("tokens_per_s" not in lb[ours] or "tokens_per_s" not in lb[bk]):
            why = "not timed (no batch fits)"
        if why:
            out[name] = dict(verdict="n/a", detail=why)
            continue
        a, b = lb[ours]["tokens_per_s"], lb[bk]["tokens_per_s"]
        out[name] = dict(verdict=verdict([a >= b]), ours=a, base=b, ratio=a / b,
                         detail=f"{a:.0f} tok/s at B{lb[ours]['batch']} vs {b:.0f} tok/s at B{lb[bk]['batch']} "
                                f"({a / b:.3f}x)")
    return out


def run(report, copy_gbps, quick=False, device="cuda"):
    """The suite, as python -m torch_fused.bench step runs it. --quick: 2 layers, S = 2048, eager
    only, the largest batch by doubling only; the full suite: the published configuration."""
    cfg = Config(**asdict(QUICK if quick else FULL))
    kw = dict(modes=("eager",), reps=3, bisect=False, max_batch_cap=128, budget_s=90) if quick else dict(budget_s=300)
    run_config(report, cfg, quick, device, **kw)


def run_config(report, cfg: Config, quick, device, **kw):
    """measure(cfg, device, **kw) into report: its extra["step"] and one row per timed step."""
    from .common import Row

    res = measure(cfg, device, **kw, log=lambda s: print(s, flush=True))
    res["quick"] = quick
    report.extra["step"] = res
    shape = f"{cfg.layers}L H{cfg.hidden} V{cfg.vocab} S{cfg.seq}"
    for key, r in res["equal_batch"].items():
        path, mode = key.split()
        report.rows.append(Row(f"step, micro-batch {cfg.batch}, {mode}", shape, path, r["ms"], 0,
                               peak_extra_mb=r["peak_mib"], note=f"{r['tokens_per_s']:.0f} tok/s; {r['note']}".rstrip("; ")))
    for key, r in res["largest_batch"].items():
        if "ms" in r:
            path, mode = key.split()
            report.rows.append(Row(f"step, largest micro-batch, {mode}", f"{shape} B{r['batch']}", path, r["ms"], 0,
                                   note=f"{r['tokens_per_s']:.0f} tok/s"))


# ---------------------------------------------------------------------------------------------
# result files


def markdown(report) -> str:
    res = report.extra["step"]
    cfg = res["config"]
    lines = [
        f"Device: {report.device}; torch {report.torch}; triton {report.triton}"
        + (f"; trl {res['versions']['trl']}" if "trl" in res["versions"] else ""),
        "",
        f"One GRPO training step: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads"
        + (f" ({cfg['kv_heads']} key/value heads)" if cfg.get("kv_heads") else "")
        + f", MLP {cfg['intermediate']}, vocab {cfg['vocab']} (untied head), {cfg['dtype']} parameters, "
        f"{res['params'] / 1e6:.1f}M parameters ({res['param_mib']:.0f} MiB); sequences of {cfg['seq']} tokens, "
        f"the first {cfg['prompt']} outside the completion mask."
        + (" Activation checkpointing per block." if cfg.get("checkpoint") else "")
        + (" SinkGD with stochastic rounding of the bf16 parameters." if cfg.get("stochastic_round") else "")
        + (" Quick run (--quick): not the published configuration." if res.get("quick") else ""),
        "",
        f"At micro-batch {cfg['batch']} ({cfg['batch'] * cfg['seq']} tokens); peak = max_memory_allocated over one "
        "step; held = parameters + optimizer state between steps (state = held - parameters). Compiled: every "
        "block and the head + loss "
        "under torch.compile(fullgraph=True); first step = compilation + first run. tokens/s counts every "
        f"token of the micro-batch. The trl path scores only the {cfg['seq'] - max(cfg['prompt'] - 1, 0) - 1} "
        f"completion positions of each sequence's {cfg['seq'] - 1} (as TRL's trainers do on a Triton device), "
        "the others all of them.",
        "",
        "| path | mode | step ms | tokens/s | peak MiB | held MiB | state MiB | first step s | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, r in res["equal_batch"].items():
        path, mode = key.split()
        pk = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        hd = "" if r["held_mib"] is None else f"{r['held_mib']:.0f}"
        stt = "" if r["held_mib"] is None else f"{r['held_mib'] - res['param_mib']:.0f}"
        lines.append(f"| {path} | {mode} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {pk} | {hd} | {stt} | "
                     f"{r['first_step_s']:.1f} | {r['note']} |")
    for key, err in res["errors"].items():
        lines.append(f"| {key} | | | | | | | | failed: {err} |")
    for path, why in res["skipped"].items():
        lines.append(f"| {path} | | | | | | | | skipped: {why} |")
    if res["largest_batch"]:
        lines += ["", "Largest micro-batch that fits (eager only: compiling every candidate batch would take too "
                  "long), found by doubling" + ("" if res.get("quick") else " then bisection to 1/8 of it")
                  + ", and tokens/s there:", "",
                  "| path | largest micro-batch | step ms | tokens/s |", "|---|---:|---:|---:|"]
        for key, r in res["largest_batch"].items():
            cap = " (the search's cap)" if r.get("capped") else ""
            cap += " (search cut short by the time budget)" if r.get("cut_short") else ""
            ms = f"{r['ms']:.1f}" if "ms" in r else ""
            tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else ""
            lines.append(f"| {key.split()[0]} | {r['batch']}{cap} | {ms} | {tps} |")
    lines += ["", "| target | verdict | measured |", "|---|---|---|"]
    for name, b in res["bars"].items():
        lines.append(f"| {name} | {b['verdict']} | {b['detail']} |")
    lines += ["", f"Suite wall time: {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report.extra["step"]
    colors = {"materialized": "tab:gray", "trl": "tab:blue", "torch_fused": "tab:green"}
    eq = res["equal_batch"]
    lb = res["largest_batch"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    keys = list(eq)
    for ax, field_, title in ((axes[0], "tokens_per_s", f"tokens/s at micro-batch {res['config']['batch']}"),
                              (axes[1], "peak_mib", f"peak GiB at micro-batch {res['config']['batch']}")):
        vals = [(eq[k][field_] or 0) / (1024 if field_ == "peak_mib" else 1) for k in keys]
        ax.barh(range(len(keys)), vals, color=[colors[k.split()[0]] for k in keys])
        ax.set_yticks(range(len(keys)))
        ax.set_yticklabels(keys, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=8)
    lk = [k for k in lb if "tokens_per_s" in lb[k]]
    axes[2].barh(range(len(lk)), [lb[k]["tokens_per_s"] for k in lk], color=[colors[k.split()[0]] for k in lk])
    axes[2].set_yticks(range(len(lk)))
    axes[2].set_yticklabels([f"{k} B{lb[k]['batch']}" for k in lk], fontsize=7)
    axes[2].invert_yaxis()
    axes[2].set_title("tokens/s at each path's largest micro-batch", fontsize=8)
    cfg = res["config"]
    fig.suptitle(f"GRPO step, {report.device}: {cfg['layers']} layers, H{cfg['hidden']}, V{cfg['vocab']}, "
                 f"S{cfg['seq']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(report, out_dir: Path, name: str) -> None:
    common.save(report, out_dir, name, markdown, plot)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m torch_fused.bench.step",
                                 description="The GRPO training-step suite on any device; --tiny: a tiny model "
                                             "(a check of the code paths, e.g. on CPU).")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (vocab 512, 2 layers, hidden 64); "
                                                        "the same as --preset tiny")
    ap.add_argument("--preset", default=None, choices=tuple(PRESETS),
                    help="the model and run settings: default (the step suite's), quick, tiny, llama3-8b (the "
                         "step_8b suite's: 32 layers, hidden 4096, vocab 128256, checkpointing, SinkGD with "
                         "stochastic rounding)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention)")
    ap.add_argument("--checkpoint", default=None, choices=("0", "1"), help="activation checkpointing per block")
    ap.add_argument("--stochastic-round", default=None, choices=("0", "1"),
                    help="SinkGD's stochastic rounding of bf16 parameters (torch_fused path)")
    ap.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated from {','.join(PATHS)}")
    ap.add_argument("--no-max-batch", action="store_true", help="skip the largest-micro-batch search")
    ap.add_argument("--max-batch-cap", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="parameter dtype (default: bfloat16; float32 with --tiny)")
    ap.add_argument("--out", default=None, metavar="DIR", help="write step.json/.md/.png there")
    for f in ("layers", "hidden", "heads", "intermediate", "seq", "batch", "vocab"):
        ap.add_argument(f"--{f}", type=int, default=None)
    args = ap.parse_args(argv)
    if args.tiny and args.preset not in (None, "tiny"):
        raise SystemExit(f"--tiny: the tiny preset; it contradicts --preset {args.preset}")
    cfg = Config(**asdict(PRESETS[args.preset or ("tiny" if args.tiny else "default")]))
    for f in ("layers", "hidden", "heads", "intermediate", "seq", "batch", "vocab", "kv_heads"):
        if getattr(args, f) is not None:
            setattr(cfg, f, getattr(args, f))
    for f in ("checkpoint", "stochastic_round"):
        if getattr(args, f) is not None:
            setattr(cfg, f, getattr(args, f) == "1")
    if args.dtype is not None:
        cfg.dtype = args.dtype
    cfg.prompt = min(cfg.prompt, cfg.seq // 4)
    res = measure(cfg, args.device, modes=tuple(m for m in args.modes.split(",") if m),
                  paths=tuple(p for p in args.paths.split(",") if p), reps=args.reps,
                  max_batch=not args.no_max_batch, max_batch_cap=args.max_batch_cap,
                  log=lambda s: print(s, flush=True))
    if args.out:
        from .common import new_report

        report = new_report()
        report.extra["step"] = res
        save(report, Path(args.out), "step")
    if res["errors"]:
        raise SystemExit(f"failed: {json.dumps(res['errors'], indent=1)}")


if __name__ == "__main__":
    main()
