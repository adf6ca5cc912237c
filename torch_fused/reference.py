"""Plain-PyTorch implementations: the CPU path of every op and the readable spec of what the
Triton kernels compute.

They work on row chunks (never a Python loop over single rows) so that a CPU call never holds
more than a chunk's worth of temporaries. They use the kernels' formulas, with intermediates in
float64 (the kernels accumulate in fp32); outputs have the kernels' dtypes.
"""

from __future__ import annotations

import math

import torch

from ._library import LN2, LOG2E, SCALE_MAX, T_MAX, T_MIN, acc_dtype, kernel_temperature, traced_constants
from .settings import current as _settings


def _chunks(rows: int, v: int, elems: int | None = None):
    step = max(1, (_settings.reference_chunk_elems if elems is None else elems) // max(v, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _row_chunks(x: torch.Tensor, step: int):
    """(a, b, rows a..b of x [..., V] as [b - a, V]) in chunks of at most ``step`` rows, without a
    copy of the whole of x where its rows are not one strided run (the shifted slice [..., :-1, :]
    of [B, L+1, V]): there each chunk stays inside one [L, V] block, a view."""
    v = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    if rows == 0:
        return
    try:
        x2 = x.view(rows, v)
    except RuntimeError:
        x2 = None
    if x2 is not None:
        for a in range(0, rows, step):
            yield a, min(rows, a + step), x2[a:a + step]
        return
    inner = x.shape[-2]
    x3 = x.reshape(-1, inner, v)  # a view for a slice of a tensor whose leading dims collapse
    for o in range(x3.shape[0]):
        for a in range(0, inner, step):
            b = min(inner, a + step)
            yield o * inner + a, o * inner + b, x3[o, a:b]


def _index_2d(index: torch.Tensor | None, lead_shape) -> torch.Tensor | None:
    """Index as [rows, K] int64 (K = 1 for one id per row)."""
    if index is None:
        return None
    k = index.shape[-1] if index.dim() == len(lead_shape) + 1 else 1
    return index.reshape(math.prod(lead_shape), k).long()


def check_index_range(index: torch.Tensor, v: int, ignore_index: int) -> None:
    """Raise a clear error for an index outside [0, V) that is not ignore_index.

    Only called where reading the index costs no device sync (CPU tensors)."""
    if index.numel() == 0:
        return
    bad = ((index < 0) | (index >= v)) & (index != ignore_index)
    if bool(bad.any()):
        first = index[bad].reshape(-1)[0].item()
        raise IndexError(
            f"index: value {first} is outside [0, V={v}) and is not ignore_index={ignore_index}"
        )




def _temperature_value(temperature: float, temperature_t: torch.Tensor | None) -> float:
    """The temperature as a Python float; a tensor one is read here (the reference path only:
    the kernels read it on the device) and must be positive."""
    if temperature_t is None:
        return kernel_temperature(temperature)
    t = float(temperature_t)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"temperature: expected a positive finite number, got {t}")
    return kernel_temperature(t)


def temperature_grad_dtype(logits: torch.Tensor, temperature_t: torch.Tensor | None) -> torch.dtype:
    """The dtype d T is computed and returned in: float64 where the logits or the tensor temperature
    are float64 (a float64 T far from 1 has a gradient past fp32's range: T = 1e-20 gives about
    1e40), else float32."""
    if logits.dtype == torch.float64 or (temperature_t is not None and temperature_t.dtype == torch.float64):
        return torch.float64
    return torch.float32


def temperature_grad(xdx_rows: torch.Tensor, temperature_t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """d T = -(1/T) * sum over rows of sum_j x_j d x_j (the kernels' per-row partials, summed in
    a fixed order, in ``dtype``: temperature_grad_dtype); an empty tensor when the temperature is a float. A positive finite T outside
    [T_MIN, T_MAX] acts as the nearer end, a constant there: d T = 0 (as torch.clamp's gradient)."""
    if temperature_t is None:
        return xdx_rows.new_empty(0)
    dt = -(xdx_rows.to(dtype).sum() / temperature_t.to(dtype).clamp(T_MIN, T_MAX))
    return torch.where(temperature_clamped(temperature_t), torch.zeros_like(dt), dt)


def temperature_clamped(temperature_t: torch.Tensor) -> torch.Tensor:
    """Whether a tensor temperature is positive and finite but outside [T_MIN, T_MAX] (a bool
    tensor): the ops act at the nearer end there and do not depend on it (d T = 0). Compared in
    its own dtype, as the kernels do (a float64 1e-300 is positive)."""
    t = temperature_t
    return (t > 0) & (t < math.inf) & ((t < T_MIN) | (t > T_MAX))


def sampler_threshold(logits: torch.Tensor, temperature_t: torch.Tensor | None, opts) -> torch.Tensor:
    """The sampler's support as one threshold per row: tau such that the support is
    {j : x_j >= tau}, as the public log-prob ops apply ``top_k``, ``top_p`` and ``min_p``
    (meta.logprobs.LogprobOptions) around the core ops.

    The rule (vLLM's sampler, "processed logprobs"), per row of z = logits / T:
      1. min-p: keep z_j >= max z + ln(min_p), i.e. p_j >= min_p * max p;
      2. top-k: keep z_j >= the k-th largest z of the row (every id tied with it is kept);
      3. top-p: over the ids kept so far, with p renormalized over them and taken in descending
         order, keep an id while the probability of the ids strictly before it is < top_p (the
         largest is always kept); the cut is a value, so ids tied with the last kept one are
         kept too (a sort may split such a tie: ours keeps it whole);
    then renormalize over the kept ids. The thresholds are constants of the step (no gradient
    flows through them); min-p and top-k compare z, so they use the logits themselves:
    tau = max(max x + T ln(min_p), k-th largest x, the top-p cut), each step only where asked
    (top_k >= V, top_p = 1 and min_p = 0 ask nothing: tau -inf keeps every id).

    Returns tau, shaped like the rows (``logits.shape[:-1]``; with ``opts.shift`` the positions
    0..L-1 of [..., L+1, V]), float32 (float64 for float64 logits), computed in that dtype:
    max x + round(T ln min_p), T as the kernels clamp it. The top-p step sorts each row (O(V log V)
    work and temporaries of a chunk of rows: this is the readable spec and the CPU path; the
    Triton kernels (kernels/sampler.py) find the same thresholds without sorting)."""
    ninf = float("-inf")
    x_all = logits[..., :-1, :] if opts.shift else logits
    lead, v = x_all.shape[:-1], x_all.shape[-1]
    rows = math.prod(lead)
    dt = acc_dtype(logits.dtype)
    out = torch.empty(lead, dtype=dt, device=logits.device)
    tau_rows = out.view(rows)
    if temperature_t is not None:
        t = temperature_t.detach().to(dt).clamp(T_MIN, T_MAX)
    else:
        t = kernel_temperature(opts.temperature)
    budget = _settings.sampler_rule_chunk_bytes.get(logits.device.type)
    elems = _settings.reference_chunk_elems if budget is None else budget // 4
    with torch.no_grad():
        for a, b, x_rows in _row_chunks(x_all.detach(), max(1, elems // max(v, 1))):
            x = x_rows.to(dt)
            tau = min_p_top_k_threshold(x, t, opts)
            if opts.top_p is not None and opts.top_p < 1.0:
                xs = x.sort(dim=-1, descending=True).values
                probs = torch.softmax(torch.where(xs >= tau, xs, ninf) / t, -1)
                before = torch.cumsum(probs, -1) - probs  # the kept probability of the ids before each
                n_kept = (before < opts.top_p).sum(-1, keepdim=True).clamp_min(1)
                tau = torch.maximum(tau, xs.gather(-1, n_kept - 1))
            tau_rows[a:b] = tau[:, 0]
    return out


def min_p_top_k_threshold(x: torch.Tensor, t, opts, top_values: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1 and 2 of sampler_threshold's rule for rows x [rows, V] (in the threshold's dtype),
    temperature t (a float, or [rows, 1]): tau [rows, 1], -inf where neither step applies.
    ``top_values``: ``x.topk(k).values`` for a k >= top_k already at hand (the fused head's support
    listing), whose column top_k - 1 is the k-th largest value: no second top-k pass."""
    v = x.shape[-1]
    tau = torch.full((x.shape[0], 1), float("-inf"), dtype=x.dtype, device=x.device)
    if opts.min_p is not None and opts.min_p > 0.0:
        tau = torch.maximum(tau, x.amax(-1, keepdim=True) + t * math.log(opts.min_p))
    if opts.top_k is not None and opts.top_k < v:
        kth = (x.topk(opts.top_k, dim=-1).values if top_values is None else top_values)[..., opts.top_k - 1:opts.top_k]
        tau = torch.maximum(tau, kth)
    return tau


def sampler_outside(logits: torch.Tensor, index: torch.Tensor, tau: torch.Tensor, opts) -> torch.Tensor:
    """Whether each id of ``index`` lies outside the support of threshold ``tau``
    (sampler_threshold): its logit is below tau (ignore_index and ids outside [0, V) are not).
    Shaped like index; a gather of the ids' logits, O(index) work."""
    rows = logits[..., :-1, :] if opts.shift else logits
    idx2 = index if index.dim() == rows.dim() else index[..., None]
    safe = idx2.clamp(0, rows.shape[-1] - 1)
    with torch.no_grad():
        chosen = rows.detach().gather(-1, safe).to(tau.dtype)
        outside = (chosen < tau[..., None]) & (idx2 != opts.ignore_index) & (idx2 >= 0) & (idx2 < rows.shape[-1])
    return outside if index.dim() == rows.dim() else outside[..., 0]


def logprobs_entropy_forward(
    logits: torch.Tensor,
    index: torch.Tensor | None,
    temperature_t: torch.Tensor | None,
    opts,
    threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (logp shaped like index or empty, entropy [lead] or empty, stats [lead, 2]) for the
    options ``opts`` (meta.logprobs.LogprobOptions). ``temperature_t``, a 0-dim tensor, replaces
    ``opts.temperature`` when given. With ``opts.shift``, logits are [..., L+1, V] and only
    positions 0..L-1 are scored (lead = [..., L]). ``threshold`` (shaped [lead]: the sampler's
    support, sampler_threshold): a row's logits below its threshold count as -inf, chunk by
    chunk (no masked copy of the logits); an id there scores -inf.

    With c = log2(e) / T, m the row max of the logits and d = (x - m) c:
    stats = (m, log2 s) with s = sum 2^d; logp = (d[index] - log2 s) ln2 (0 at ignore_index,
    NaN at an index outside [0, V) on devices that cannot check it); entropy
    H = (log2 s - sum 2^d d / s) ln2. Intermediates are float64 here (the kernels use fp32 and
    the same formulas); outputs are float32, float64 for float64 logits.
    """
    temperature, ignore_index, compute_entropy, shift = opts.temperature, opts.ignore_index, opts.compute_entropy, \
        opts.shift
    if shift:
        logits = logits[..., :-1, :]
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    rows = math.prod(lead)
    dt = acc_dtype(logits.dtype)
    temperature = _temperature_value(temperature, temperature_t)
    idx2 = _index_2d(index, lead)
    if idx2 is not None and logits.device.type == "cpu":
        check_index_range(idx2, v, ignore_index)
    x2 = logits.reshape(rows, v)
    # outputs allocated in their final shapes (never returned as views: a caller may write into
    # them) and filled through flat views
    stats_out = torch.empty(*lead, 2, dtype=dt, device=logits.device)
    ent_out = torch.empty(lead if compute_entropy else (0,), dtype=dt, device=logits.device)
    stats, ent = stats_out.view(rows, 2), ent_out.view(-1)
    logp_out = logp = None
    if idx2 is not None:
        logp_out = torch.empty(index.shape, dtype=dt, device=logits.device)
        logp = logp_out.view(idx2.shape)
    c = LOG2E / temperature
    tau2 = None if threshold is None else threshold.reshape(rows, 1).double()
    for a, b in _chunks(rows, v):
        x = x2[a:b].double()
        if tau2 is not None:
            x = _below_threshold(x, tau2[a:b])
        m = x.amax(dim=-1, keepdim=True)
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m).to(dt).double()
        d = (x - m) * c
        e = torch.exp2(d)
        s = e.sum(-1)
        log2s = torch.log2(s)
        stats[a:b, 0] = m.squeeze(-1).to(dt)
        stats[a:b, 1] = log2s.to(dt)
        if compute_entropy:
            t = torch.where(e > 0, e * d, torch.zeros_like(d)).sum(-1)
            ent[a:b] = ((log2s - t / s) * LN2).to(dt)
        if idx2 is not None:
            ib = idx2[a:b]
            valid = (ib >= 0) & (ib < v)
            g = (torch.gather(d, 1, ib.clamp(0, max(v - 1, 0))) - log2s[:, None]) * LN2
            g = torch.where(valid, g, torch.full_like(g, float("nan")))
            logp[a:b] = torch.where(ib == ignore_index, torch.zeros_like(g), g).to(dt)
    if logp_out is None:
        logp_out = stats.new_empty(0)
    return logp_out, ent_out, stats_out


def _below_threshold(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """x with its values below tau (broadcast) as -inf; a NaN stays NaN."""
    return torch.where(x < tau, torch.full((), float("-inf"), dtype=x.dtype, device=x.device), x)


def logprobs_entropy_backward(
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    index: torch.Tensor | None,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    temperature_t: torch.Tensor | None,
    opts,
    temperature_grad: bool = True,
    *,
    v_off: int = 0,
    v_total: int | None = None,
    out_dtype: torch.dtype | None = None,
    threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d logits, d T) of sum(grad_logp * logp) + sum(grad_entropy * entropy); d T only for a
    tensor temperature with ``temperature_grad`` (else an empty tensor): d T = -(1/T) sum x * d logits,
    as z = x / T, in temperature_grad_dtype (float64 where T or the logits are float64).
    With ``shift``, d logits is [..., L+1, V] with exactly zero rows L. Keyword-only, for the
    fused lm_head: the logits may be columns v_off .. v_off + V - 1 of a vocabulary of
    ``v_total`` (stats and entropy of the whole rows; G counts every id, the scatter only those
    in the slice), and d logits may be of ``out_dtype``.

    With p = softmax(z), lp = log p, H the entropy, gH its gradient and G the sum of grad_logp
    over the row's valid indices:  d z_j = sum_k g_k [j == idx_k] - p_j (G + gH (lp_j + H)),
    and d logits = d z / T. Only stats and H are saved from the forward. ``threshold`` (the
    forward's): logits below it count as -inf (d logits 0 there), and an id whose logit is below
    it passes no gradient (its log-prob was -inf), neither to its own logit nor through G.
    """
    temperature, ignore_index, shift = opts.temperature, opts.ignore_index, opts.shift
    out_dtype = out_dtype or logits.dtype
    full = torch.empty(logits.shape, dtype=out_dtype, device=logits.device)
    if shift:
        full[..., -1, :] = 0
        logits = logits[..., :-1, :]
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    rows = math.prod(lead)
    x2 = logits.reshape(rows, v)
    out = torch.empty((rows, v), dtype=out_dtype, device=logits.device) if shift else full.view(rows, v)
    v_total = v if v_total is None else v_total
    temperature = _temperature_value(temperature, temperature_t)
    want_dt = temperature_t is not None and temperature_grad
    xdx = torch.zeros((), dtype=torch.float64, device=logits.device)
    st = stats.reshape(rows, 2).double()
    idx2 = _index_2d(index, lead)
    tau2 = None if threshold is None else threshold.reshape(rows, 1).double()
    if grad_logp is not None and idx2 is not None:
        g2 = grad_logp.reshape(idx2.shape).double()
        valid = idx2 != ignore_index
        g2 = torch.where(valid, g2, torch.zeros_like(g2))
        inb = (idx2 >= 0) & (idx2 < v_total)
        # an out-of-range index gave NaN forward; its row's gradient is NaN too
        g2 = torch.where(valid & ~inb, torch.full_like(g2, float("nan")), g2)
        if tau2 is not None:  # an id below the threshold scored -inf: no gradient through it
            x_ids = x2.gather(1, (idx2 - v_off).clamp(0, max(v - 1, 0))).double()
            g2 = torch.where(inb & (x_ids < tau2), torch.zeros_like(g2), g2)
        gsum = g2.sum(-1)
    else:
        g2 = None
        gsum = torch.zeros(rows, dtype=torch.float64, device=logits.device)
    if grad_entropy is not None:
        gh = grad_entropy.reshape(rows).double()
        h = entropy.reshape(rows).double()
    log2e, ln2 = traced_constants()  # literals: Dynamo traces this in the vocabulary-parallel backward
    c = log2e / temperature
    inv_t = 1.0 / temperature
    for a, b in _chunks(rows, v):
        x = x2[a:b].double()
        if tau2 is not None:
            x = _below_threshold(x, tau2[a:b])
        lp = ((x - st[a:b, :1]) * c - st[a:b, 1:]) * ln2
        p = torch.exp(lp)
        coef = gsum[a:b, None].expand_as(p)
        if grad_entropy is not None:
            lp_safe = torch.where(p > 0, lp, torch.zeros_like(lp))
            coef = coef + gh[a:b, None] * (lp_safe + h[a:b, None])
        dz = -p * coef
        if g2 is not None:
            ib = idx2[a:b] - v_off
            inb = (ib >= 0) & (ib < v)
            dz.scatter_add_(1, torch.where(inb, ib, torch.zeros_like(ib)), torch.where(inb, g2[a:b], torch.zeros_like(g2[a:b])))
        dx = dz * inv_t
        out[a:b] = dx.to(out_dtype)
        if want_dt:  # -inf logits have dx = 0: keep their 0 * inf out
            # sum x dx = sum (x - m) dx (a row's dx sums to zero): no error from a constant offset
            xdx += torch.where(dx != 0, (x - st[a:b, :1]) * dx, torch.zeros_like(dx)).sum()
    dt_dtype = temperature_grad_dtype(logits, temperature_t)
    if not want_dt:
        dtemp = torch.empty(0, dtype=dt_dtype, device=logits.device)
    else:
        dtemp = torch.where(temperature_clamped(temperature_t), torch.zeros_like(xdx),
                            -xdx / temperature).to(dt_dtype)
    if shift:
        full[..., :-1, :] = out.view(logits.shape)
    return full, dtemp


# ---------------------------------------------------------------------------------------------
# mask_reduce
# ---------------------------------------------------------------------------------------------
def compact(t: torch.Tensor) -> torch.Tensor:
    """The stored elements of a broadcast view: every stride-0 dim shrunk to size 1.

    Same data, no copy; broadcasting it against the original shape gives the view back, so
    elementwise work on it (``compact(mask) != 0``) costs the stored size, not the logical one.
    An empty view is returned as it is (its storage may hold nothing to shrink to).

    Reads ``t``'s strides: call it only where ``t`` is a real tensor (an op's implementation, or
    eager code on the user's own inputs), never on a tensor a compiled graph made, whose layout
    the compiler chooses."""
    if t.numel() == 0:
        return t
    size = [1 if st == 0 else s for s, st in zip(t.shape, t.stride())]
    return t.as_strided(size, t.stride())


def stored_view(t: torch.Tensor | None, shape) -> torch.Tensor | None:
    """``t`` broadcast to ``shape``, as its stored elements only (see :func:`compact`)."""
    return None if t is None else compact(torch.broadcast_to(t, shape))


def mask_weight(mask: torch.Tensor, shape, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum along ``dim`` of the weights of ``mask`` broadcast to ``shape``, shaped like the
    reduction (``shape`` without ``dim``), in ``dtype``, summed on the stored elements. A floating
    mask's weights are its values (a NaN weight gives a NaN sum); a bool or integer mask's are 1
    where ``mask != 0``, else 0 (the sum is the kept count)."""
    m = stored_view(mask, shape)
    d = dim % len(shape)
    w = m.sum(d, dtype=dtype) if m.dtype.is_floating_point else (m != 0).sum(d, dtype=dtype)
    if m.shape[d] == 1:  # one stored weight stands for the whole (broadcast) dim
        w = w * shape[d]
    out_shape = tuple(shape[:d]) + tuple(shape[d + 1:])
    return torch.broadcast_to(w, out_shape).contiguous()


def mask_reduce_forward(x, dim, mask=None, scale=None, out_dtype=None):
    """sum over dim of where(mask != 0, x * scale, 0), accumulated in float32 (float64 for
    float64 x), in chunks of the leading dim so that no x-sized float temporary exists at once.
    Broadcast mask/scale are used through their stored elements only."""
    out_dtype = out_dtype or x.dtype
    acc = acc_dtype(x.dtype)
    dim = dim % x.dim()
    shape = x.shape
    m = stored_view(mask, shape)
    s = stored_view(scale, shape)
    out_shape = shape[:dim] + shape[dim + 1:]
    out = torch.empty(out_shape, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    # chunk over the first non-reduced dim (x is at most 4-D)
    cdim = 0 if dim != 0 else (1 if x.dim() > 1 else None)
    n = shape[cdim] if cdim is not None else 1
    per = max(1, x.numel() // max(n, 1))
    step = max(1, _settings.reference_chunk_elems // max(per, 1))
    for a in range(0, n, step):
        b = min(n, a + step)

        def part(t):
            if t is None or cdim is None:
                return t
            return t if t.shape[cdim] == 1 else t.narrow(cdim, a, b - a)

        xs, ms, ss = part(x), part(m), part(s)
        v = xs.to(acc)
        if ss is not None:
            v = v * ss.to(acc)
        if ms is not None:
            v = torch.where(ms != 0, v, torch.zeros((), dtype=acc, device=x.device))
        r = v.sum(dim)
        if cdim is None:
            out.copy_(r.to(out_dtype))
        else:
            out.narrow(0, a, b - a).copy_(r.to(out_dtype))  # the chunked dim is out's dim 0
    return out


def mask_reduce_backward(grad, x, dim, mask=None, scale=None):
    """dx = grad broadcast over dim, times scale, 0 where the mask drops the element; x.dtype."""
    dim = dim % x.dim()
    shape = x.shape
    m = stored_view(mask, shape)
    s = stored_view(scale, shape)
    g = grad.unsqueeze(dim)
    dx = torch.empty(shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    if s is not None:
        acc = acc_dtype(x.dtype)
        val = g.to(acc) * s.to(acc)  # broadcasts only to the union of g's and scale's dims
    else:
        val = g
    if m is not None:
        val = torch.where(m != 0, val, torch.zeros((), dtype=val.dtype, device=x.device))
    dx.copy_(torch.broadcast_to(val, shape))
    return dx


# ---------------------------------------------------------------------------------------------
# SinkGD
# ---------------------------------------------------------------------------------------------
def _rescaled(v: torch.Tensor, x: torch.Tensor, dim: int, target: float, eps: float) -> torch.Tensor:
    """v * target / max(|x|, eps) with |x| the l2 norm of x over dim, clamped at SCALE_MAX. The norm
    is computed scaled (divided by the largest |x| before squaring: an fp32 sum of squares
    overflows past about 1.8e19) and never formed: with a = max |x| and s = |x / a| in [1, sqrt(len)],
    v * (target / s) / max(a, eps / s), so that entries near the fp32 maximum, whose norm a * s
    itself overflows, still give the finite scale. A zero x (a = 0) gives v * target / eps."""
    a = x.abs().amax(dim)
    live = a > 0
    s = (x / torch.where(live, a, 1.0).unsqueeze(dim)).square().sum(dim).sqrt()
    s = torch.where(live, s, 1.0)
    return (v * (target / s) / torch.maximum(a, eps / s)).clamp_max(SCALE_MAX)


def sinkgd_scales(g: torch.Tensor, iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column scales r [B, m], c [B, n] with X = diag(r) G diag(c) after ``iters``
    SR-Sinkhorn iterations (rows to l2 norm sqrt(n), then columns to sqrt(m)) on a [B, m, n]
    gradient; float32 math (float64 for a float64 gradient), norms computed scaled (any finite
    gradient gives finite scales). The scales are clamped at 1e30 so that a (near-)zero row or
    column, whose scale would grow by sqrt(n)/eps every iteration, never overflows into
    inf * 0 = NaN."""
    b, m, n = g.shape
    dt = acc_dtype(g.dtype)
    gf = g.to(dt)
    r = torch.ones(b, m, dtype=dt, device=g.device)
    c = torch.ones(b, n, dtype=dt, device=g.device)

    def x():  # r_i g_ij c_j: X stays bounded even where r or c is huge, r alone need not
        return r[:, :, None] * gf * c[:, None, :]

    for _ in range(iters):
        r = _rescaled(r, x(), 2, math.sqrt(n), eps)
        c = _rescaled(c, x(), 1, math.sqrt(m), eps)
    return r, c


def _xmv(g: torch.Tensor, r: torch.Tensor, c: torch.Tensor, vec: torch.Tensor, transpose: bool) -> torch.Tensor:
    """X vec (or X^T vec) for X = diag(r) G diag(c), [B, m, n], in row chunks so that no copy of
    the whole gradient exists; r and c are applied to each chunk before the products, so the
    sums stay finite whatever the gradient's magnitude. In r's dtype."""
    b, m, n = g.shape
    dt = r.dtype
    step = max(1, _settings.reference_chunk_elems // max(n, 1))
    out = (torch.zeros if transpose else torch.empty)(b, n if transpose else m, dtype=dt, device=g.device)
    for a in range(0, m, step):
        xc = r[:, a:a + step, None] * g[:, a:a + step].to(dt) * c[:, None, :]
        if transpose:
            out += torch.einsum("bmn,bm->bn", xc, vec[:, a:a + step])
        else:
            out[:, a:a + step] = torch.einsum("bmn,bn->bm", xc, vec)
    return out


def spectral_restart(n: int, device=None) -> torch.Tensor:
    """The power iteration's restart vector [n], float32: cos(0.5 + 2.399963 j), dense and the same
    on every run (the optimizer's warm start is it normalized). It replaces v where w = X^T u is 0
    (a zero gradient, or v in X's null space): v = w / |w| would be 0 there, and a zero v gives
    w = 0 at every later step, and with it the scale target / eps."""
    return torch.cos(0.5 + 2.399963 * torch.arange(n, dtype=torch.float32, device=device))


def spectral_vector_and_scale(w: torch.Tensor, sigma: torch.Tensor, target: float, eps: float):
    """(v, scale) of one power iteration's w [B, n] and sigma = |w| [B]: v = w / sigma, the restart
    vector where sigma = 0; scale = target / max(sigma, eps), 0 where sigma = 0 (there X v = 0
    gives no estimate: the step leaves out X rather than multiply it by target / eps). The
    kernels (_sinkgd_power_norm_kernel) and the sharded PyTorch-op step form the same."""
    live = sigma > 0
    v = torch.where(live[:, None], w / torch.where(live, sigma, 1)[:, None],
                    spectral_restart(w.shape[1], w.device).to(w.dtype))
    scale = torch.where(live, target / sigma.clamp_min(eps), torch.zeros_like(sigma))
    return v, scale


def sinkgd_spectral_scale(g, r, c, v, iters: int, target: float, eps: float) -> torch.Tensor:
    """Power iteration on X = diag(r) G diag(c), warm-started from v [B, n] (updated in place):
    repeat iters: u = X v / max(|X v|, eps); w = X^T u; sigma = |w|; v = w / sigma (the restart
    vector where sigma = 0). Returns target / max(sigma, eps) per matrix (0 where sigma = 0), [B],
    in r's dtype (spectral_vector_and_scale)."""
    scale = torch.zeros(g.shape[0], dtype=r.dtype, device=g.device)
    for _ in range(iters):
        u = _xmv(g, r, c, v.to(r.dtype), False)
        u = u / u.norm(dim=1, keepdim=True).clamp_min(eps)
        w = _xmv(g, r, c, u, True)
        new_v, scale = spectral_vector_and_scale(w, w.norm(dim=1), target, eps)
        v.copy_(new_v)
    return scale


def sinkgd_update_(w, g, r, c, coef_x, coef_w) -> None:
    """w <- w - coef_x[b] * (r_i c_j g_ij) - coef_w * w, in float32 (float64 for a float64 w or
    g: a float64 parameter is never rounded through float32), stored in w's dtype."""
    dt = torch.promote_types(acc_dtype(w.dtype), r.dtype)
    x = r[:, :, None].to(dt) * g.to(dt) * c[:, None, :].to(dt)
    wf = w.to(dt)
    new = wf - coef_x[:, None, None].to(dt) * x - coef_w.to(dt) * wf
    w.copy_(new.to(w.dtype))


# ---------------------------------------------------------------------------------------------
# Distillation (fused::distill, fused::linear_distill)
# ---------------------------------------------------------------------------------------------
# Rows of both models' logits x (student) and y (teacher), [n, V]; c = log2(e) k with k the
# factor that turns a row's logits into z = x k (k = logit_scale / T, or 1 / T where the head
# has applied its softcap to the chunk already). As the log-prob kernels: m the row max of the
# raw logits, d = (x - m) c, s = sum 2^d; stats = (m, log2 s) per model, and log2 p = d - log2 s.
# The divergence per row (nats), with a = log2 p_s, b = log2 p_t:
#   beta 0 (mode 0): KL(t || s) = ln2 sum p_t (b - a);
#   beta 1 (mode 1): KL(s || t) = ln2 sum p_s (a - b);
#   else   (mode 2): with log2 m = log2((1 - beta) 2^a + beta 2^b), the generalized JSD
#                    ln2 sum [beta p_t (b - log2 m) + (1 - beta) p_s (a - log2 m)]
#                    (TRL's generalized_jsd_loss and ChunkedDivergenceFunction).
# Its gradient in the student's z (softmax chain rule):
#   mode 0: p_s - p_t;  mode 1: p_s (ln p_s - ln p_t - D);
#   mode 2: (1 - beta) p_s (ln p_s - ln m - KL(s || m)),
# so the backward needs D (mode 1) or KL(s || m) (mode 2) per row: ``aux``, the fifth row
# statistic. Terms of zero probability contribute 0 (never 0 * inf).


def distill_stats(xs, xt, cs: float, ct: float, want_entropy: bool):
    """(stats [n, 4] = (m_s, log2 s_s, m_t, log2 s_t), student entropy [n] or None), float64."""
    out = []
    ent = None
    for x, c, is_student in ((xs, cs, True), (xt, ct, False)):
        x = x.double()
        m = x.amax(-1, keepdim=True)
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        d = (x - m) * c
        e = torch.exp2(d)
        s = e.sum(-1)
        log2s = torch.log2(s)
        out += [m.squeeze(-1), log2s]
        if is_student and want_entropy:
            t = torch.where(e > 0, e * d, torch.zeros_like(d)).sum(-1)
            ent = (log2s - t / s) * LN2
    return torch.stack(out, -1), ent


def _distill_log2p(xs, xt, st, cs, ct):
    a = (xs.double() - st[:, 0:1]) * cs - st[:, 1:2]
    b = (xt.double() - st[:, 2:3]) * ct - st[:, 3:4]
    return a, b


def _log2_mixture(a, b, beta):
    return torch.logaddexp2(a + math.log2(1.0 - beta), b + math.log2(beta))


def _plogq(p, u):
    """sum of p * u over the row, 0 where p == 0."""
    return torch.where(p > 0, p * u, torch.zeros_like(u)).sum(-1)


def distill_divergence(xs, xt, st, beta: float, cs: float, ct: float):
    """(divergence [n], aux [n]) in nats, float64, from the rows and their stats [n, >= 4]."""
    a, b = _distill_log2p(xs, xt, st.double(), cs, ct)
    ps, pt = torch.exp2(a), torch.exp2(b)
    # a NaN logit (or a row of -inf) makes the row NaN; the p > 0 masks below would drop it
    bad = (torch.isnan(a) | torch.isnan(b)).any(-1)

    def rows(div, aux):
        nan = torch.full_like(div, float("nan"))
        return torch.where(bad, nan, div), torch.where(bad, nan, aux)

    if beta == 0.0:
        div = _plogq(pt, b - a) * LN2
        return rows(div, torch.zeros_like(div))
    if beta == 1.0:
        div = _plogq(ps, a - b) * LN2
        return rows(div, div)
    lm = _log2_mixture(a, b, beta)
    kl_s = _plogq(ps, a - lm) * LN2
    return rows(beta * _plogq(pt, b - lm) * LN2 + (1.0 - beta) * kl_s, kl_s)


def distill_grad(xs, xt, st, w, beta: float, cs: float, ct: float, k: float, softcap=None):
    """d (w_r D_r) / d x_s [n, V], float64: the student's z = x k (k = logit_scale / T), times
    (1 - (x / softcap)^2) where the rows hold softcapped logits. w [n] the rows' weights, st [n, 5]."""
    st = st.double()
    a, b = _distill_log2p(xs, xt, st, cs, ct)
    ps, pt = torch.exp2(a), torch.exp2(b)
    aux = st[:, 4:5]
    if beta == 0.0:
        dz = ps - pt
    elif beta == 1.0:
        dz = torch.where(ps > 0, ps * ((a - b) * LN2 - aux), torch.zeros_like(a))
    else:
        lm = _log2_mixture(a, b, beta)
        dz = (1.0 - beta) * torch.where(ps > 0, ps * ((a - lm) * LN2 - aux), torch.zeros_like(a))
    if beta != 0.0:  # a NaN row (aux NaN, distill_divergence's flag): NaN, not masked to 0
        dz = torch.where(torch.isnan(aux), float("nan"), dz)
    dx = dz * (w.double() * k)[:, None]
    if softcap is not None:
        dx = dx * (1.0 - (xs.double() / softcap) ** 2)
    return dx


def _distill_rows(logits, shift):
    """[rows, V] of the scored positions (a copy where a view cannot express them)."""
    x = logits[..., :-1, :] if shift else logits
    return x.reshape(-1, x.shape[-1])


def _distill_keep(labels, rows, ignore_index, device):
    if labels is None:
        return torch.ones(rows, dtype=torch.bool, device=device)
    return labels.reshape(rows) != ignore_index


def distill_logits_forward(student, teacher, labels, opts):
    """(divergence [lead], entropy [lead] or empty, stats [lead, 5]) of the logits core op
    (meta.distill.DistillOptions ``opts``; the logits path has no logit_scale or softcap)."""
    lead = (student[..., :-1, :] if opts.shift else student).shape[:-1]
    rows, v = math.prod(lead), student.shape[-1]
    dt = acc_dtype(student.dtype)
    div = torch.empty(lead, dtype=dt, device=student.device)
    ent = torch.empty(lead if opts.compute_entropy else (0,), dtype=dt, device=student.device)
    stats = torch.empty(tuple(lead) + (5,), dtype=dt, device=student.device)
    xs, xt = _distill_rows(student, opts.shift), _distill_rows(teacher, opts.shift)
    keep = _distill_keep(labels, rows, opts.ignore_index, student.device)
    c = LOG2E / kernel_temperature(opts.temperature)
    d2, e2, s2 = div.view(rows), ent.view(-1), stats.view(rows, 5)
    for a, b in _chunks(rows, 2 * v):
        st, h = distill_stats(xs[a:b], xt[a:b], c, c, opts.compute_entropy)
        d, aux = distill_divergence(xs[a:b], xt[a:b], st, opts.beta, c, c)
        kb = keep[a:b]
        s2[a:b, :4] = torch.where(kb[:, None], st, torch.zeros_like(st)).to(dt) if not opts.compute_entropy else st.to(dt)
        s2[a:b, 4] = torch.where(kb, aux, torch.zeros_like(aux)).to(dt)
        d2[a:b] = torch.where(kb, d, torch.zeros_like(d)).to(dt)
        if opts.compute_entropy:
            e2[a:b] = h.to(dt)
    return div, ent, stats


def distill_logits_backward(grad_div, student, teacher, labels, stats, opts):
    """d student_logits of sum(grad_div * divergence): [..., L(+1), V] in the student's dtype,
    zero at ignored positions (and at the last position with shift)."""
    out = torch.zeros(student.shape, dtype=student.dtype, device=student.device)
    rows_view = out[..., :-1, :] if opts.shift else out
    lead = rows_view.shape[:-1]
    rows, v = math.prod(lead), student.shape[-1]
    xs, xt = _distill_rows(student, opts.shift), _distill_rows(teacher, opts.shift)
    keep = _distill_keep(labels, rows, opts.ignore_index, student.device)
    t = kernel_temperature(opts.temperature)
    c = LOG2E / t
    g = grad_div.reshape(rows)
    st = stats.reshape(rows, 5)
    dx = torch.empty(rows, v, dtype=student.dtype, device=student.device)
    for a, b in _chunks(rows, 2 * v):
        kb = keep[a:b]
        d = distill_grad(xs[a:b], xt[a:b], st[a:b], g[a:b], opts.beta, c, c, 1.0 / t)
        dx[a:b] = torch.where(kb[:, None], d, torch.zeros_like(d)).to(student.dtype)
    rows_view.copy_(dx.view(rows_view.shape))
    return out


def _row_logsumexp(x, live):
    """logsumexp over the last dim, -inf for rows without a used slot (``live`` False), made
    without a 0 * NaN in its gradient there (a dead row's logsumexp is taken of zeros)."""
    return torch.where(live, torch.logsumexp(torch.where(live, x, torch.zeros_like(x)), -1, keepdim=True),
                       torch.full_like(x[..., :1], float("-inf")))


def _with_tail(lp, live):
    """lp [..., k] (log-probs of k ids, -inf at unused slots) with a (k+1)-th category holding
    1 - sum p, its log clamped as TRL's _add_tail_bucket clamps it (log sum p <= -1e-7: the tail
    keeps at least about 1e-7; past the clamp it has no gradient)."""
    log_sum = _row_logsumexp(lp, live).clamp(max=-1e-7)
    return torch.cat([lp, torch.log(-torch.expm1(log_sum))], -1)


def distill_topk(lp_s, lp_t, valid, beta: float, tail: str):
    """The per-position divergence [...] over a top-k support (differentiable in lp_s): lp_s the
    student's full-vocabulary log-probs at the k ids, lp_t the teacher's as given, ``valid`` the
    used slots (the others take no part on either side). tail "bucket": a (k+1)-th category with
    1 - sum p on each side; "renormalize": both sides renormalized over the used ids (a position
    without one gives 0). Then the divergence of ``beta`` (see above) over the categories, a
    category of zero probability contributing 0. In lp_s's dtype. Every transcendental function
    sees finite stand-ins at unused slots, so no NaN enters the gradient of a used one."""
    ninf = torch.full((), float("-inf"), dtype=lp_s.dtype, device=lp_s.device)
    zero = torch.zeros((), dtype=lp_s.dtype, device=lp_s.device)
    live = valid.any(-1, keepdim=True)
    a = torch.where(valid, lp_s, ninf)
    b = torch.where(valid, lp_t.to(lp_s.dtype), ninf)
    if tail == "bucket":
        a, b = _with_tail(a, live), _with_tail(b, live)
        mask = torch.cat([valid, torch.ones_like(valid[..., :1])], -1)
    else:
        a, b = a - _row_logsumexp(a, live), b - _row_logsumexp(b, live)
        mask = valid
    sa, sb = torch.where(mask, a, zero), torch.where(mask, b, zero)
    pa = torch.where(mask, sa.exp(), zero)
    pb = torch.where(mask, sb.exp(), zero)

    def plogq(p, u):
        return torch.where(p > 0, p * u, zero)

    if beta == 0.0:
        terms = plogq(pb, sb - sa)
    elif beta == 1.0:
        terms = plogq(pa, sa - sb)
    else:
        lm = torch.logaddexp(sa + math.log1p(-beta), sb + math.log(beta))
        terms = beta * plogq(pb, sb - lm) + (1.0 - beta) * plogq(pa, sa - lm)
    return terms.sum(-1)
