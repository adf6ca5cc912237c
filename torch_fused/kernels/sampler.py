"""Triton kernels of the sampler's support: one threshold tau per row such that the support is
{j : x_j >= tau}, the rule of reference.sampler_threshold (min-p, then top-k, then top-p over
what min-p and top-k kept; ties kept whole), without a sort and without a copy of the logits.

Keys. A float's order key is its bit pattern with the low 31 bits flipped for negative numbers,
compared as a signed int32 (``_key``; -0.0 is taken as +0.0). A threshold is searched on the
keys' grid of multiples of 2^LO_BIT: bf16 and fp16 logits widened to fp32 have their low 16 and
13 bits zero, so each key of that grid holds one value at most and the search stops there.
``_select`` finds the largest grid key r with sum_{key >= r} w >= target by bisection over the
bits (counts w = 1: the k-th largest; probability masses: the top-p cut, whose value tau3 is the
largest with mass(x >= tau3) >= top_p * mass: the cumulative mass of the ids strictly above the
last kept one is below top_p, as the rule reads).

Three kernels, one per route (ops/sampler.py picks them):
- ``_sampler_filter_kernel`` (min-p and/or top-k, then top-p if asked): two streaming passes over
  the row. The first keeps a max per lane of a block, whence a lower bound L of tau (the row's
  max + T ln min_p; the k-th largest lane max); the second appends every element >= L to a
  working list (position and value, in the program's scratch) through an atomic count, with no
  reduction or branch per block. The list, put in position order, holds the whole support: tau
  comes from it, and top-p then runs over it. Split (the ``sampler_filter_split`` setting):
  the streaming programs leave each row's list to ``_sampler_filter_tail_kernel``, one small
  program per row, which finds tau in it.
- ``_sampler_top_p_kernel`` (top-p alone): the row's statistics (max m and sum s of 2^((x-m)c),
  the log-prob kernels' own numerics) with a strided sample of the row, from which the cut is
  estimated (the sample's mass below it against the exact (1 - top_p) s); a second pass sums the
  mass above a band of sample values around that estimate and lists the band's elements (raising
  the band's floor should the list fill), and the cut is found in the band.
- ``_sampler_exact_kernel``: the rows the others could not settle (a list that overflowed: more
  ties at the top than the list holds, or a band that missed the cut), or every row where the
  fast routes do not apply (a top_k past the list's capacity): max, then digit-by-digit
  searches (4 bits a pass) of counts and masses over the whole row.

Every route ends with the row's tau and its support list: the positions of the kept ids in
ascending order with their count in front when they fit SUPPORT_CAP (meta/sampler.py), else
count -1 (also for a row holding a NaN, which is in no list). The log-prob forward then sums a
listed row's listed logits alone, and the backward writes its gradient without reading its
logits (kernels/logprobs.py). Status -2 in the count marks a row for the exact kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..settings import INTERPRET
from .logprobs import LOG2E_C, T_MAX_C, T_MIN_C, _forward_combine, _forward_update, _row_base, _shifted

KEY_MIN = tl.constexpr(-2147483648)
NEEDS_EXACT = tl.constexpr(-2)
NOT_LISTED = tl.constexpr(-1)
# Triton's interpreter has no libdevice: its fp32 products are rounded once anyway (numpy)
_INTERP = tl.constexpr(INTERPRET)


@triton.jit
def _key(x):
    """Order key of fp32 values (signed int32 order = float order, -0.0 as +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(r, LO_BIT: tl.constexpr):
    """The value of the elements whose keys lie in the grid bucket [r, r + 2^LO_BIT): their low
    LO_BIT bits are all zero (non-negative keys) or all one (negative keys)."""
    k = tl.where(r < 0, r | ((1 << LO_BIT) - 1), r)
    bits = k ^ ((k >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _temperature(t_arg, p_temp, T_FROM_PTR: tl.constexpr):
    """T in fp32: the launch's float, or (T_FROM_PTR) a device scalar clamped as the log-prob
    kernels clamp it (a T <= 0, inf or NaN gives NaN)."""
    if T_FROM_PTR:
        t = tl.load(p_temp)
        ok = (t > 0.0) & (t < float("inf"))
        t = tl.minimum(tl.maximum(t, T_MIN_C), T_MAX_C)
        return tl.where(ok, t, float("nan")).to(tl.float32)
    else:
        return tl.cast(t_arg, tl.float32)


@triton.jit
def _min_p_shift(t, min_p_arg, T_FROM_PTR: tl.constexpr):
    """T ln(min_p) in fp32 as the rule rounds it: the host's product for a float T (min_p_arg),
    else round(T * round(ln min_p)) (min_p_arg = ln min_p), a product no fma may absorb."""
    if T_FROM_PTR:
        if _INTERP:
            return t * tl.cast(min_p_arg, tl.float32)
        else:
            return libdevice.mul_rn(t, tl.cast(min_p_arg, tl.float32))
    else:
        return tl.cast(min_p_arg, tl.float32)


@triton.jit
def _list_sum(p_val, n, floor, m, c, EXACT_SHIFT: tl.constexpr, CHUNK: tl.constexpr):
    """sum of 2^((x - m) c) over the list's n values x >= floor."""
    o = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for i0 in range(0, n, CHUNK):
        v = tl.load(p_val + i0 + o, mask=i0 + o < n, other=float("-inf"))
        acc += tl.where(v >= floor, tl.exp2(_shifted(v, m, c, EXACT_SHIFT)), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _list_max(p_val, n, CHUNK: tl.constexpr):
    o = tl.arange(0, CHUNK)
    acc = tl.full([CHUNK], float("-inf"), tl.float32)
    for i0 in range(0, n, CHUNK):
        acc = tl.maximum(acc, tl.load(p_val + i0 + o, mask=i0 + o < n, other=float("-inf")))
    return tl.max(acc, 0)


@triton.jit
def _list_count_ge(p_val, n, r, CHUNK: tl.constexpr):
    """How many of the list's n values have a key >= r."""
    o = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.int32)
    for i0 in range(0, n, CHUNK):
        v = tl.load(p_val + i0 + o, mask=i0 + o < n, other=float("-inf"))
        acc += ((i0 + o < n) & (_key(v) >= r)).to(tl.int32)
    return tl.sum(acc, 0)


@triton.jit
def _finish_list(p_tau, p_sup_row, row, tau, p_val, p_pos, n, SUP_CAP: tl.constexpr, CHUNK: tl.constexpr):
    """Stores the row's tau and its support list: the positions of the list's values >= tau (the
    list holds every element >= tau, in order), with their count when it is at most SUP_CAP,
    else count -1."""
    o = tl.arange(0, CHUNK)
    total = tl.full((), 0, tl.int32)
    for i0 in range(0, n, CHUNK):
        live = i0 + o < n
        v = tl.load(p_val + i0 + o, mask=live, other=float("-inf"))
        pos = tl.load(p_pos + i0 + o, mask=live, other=0)
        keep = live & (v >= tau)
        ki = keep.to(tl.int32)
        off = total + tl.cumsum(ki, 0) - ki
        tl.store(p_sup_row + 1 + off, pos, mask=keep & (off < SUP_CAP))
        total += tl.sum(ki, 0)
    tl.store(p_sup_row, tl.where(total <= SUP_CAP, total, NOT_LISTED))
    tl.store(p_tau + row, tau)


@triton.jit
def _compact(p_val, p_pos, cnt, floor, r, CHUNK: tl.constexpr):
    """Compacts the list in place to its elements >= floor with a key >= r, a chunk at a time (a chunk's
    stores land at or before its own place, after every thread has read it). Returns the count."""
    o = tl.arange(0, CHUNK)
    total = tl.full((), 0, tl.int32)
    for i0 in range(0, cnt, CHUNK):
        live = i0 + o < cnt
        v = tl.load(p_val + i0 + o, mask=live, other=float("-inf"))
        pos = tl.load(p_pos + i0 + o, mask=live, other=0)
        keep = live & (v >= floor) & (_key(v) >= r)
        ki = keep.to(tl.int32)
        off = total + tl.cumsum(ki, 0) - ki
        tl.debug_barrier()  # every thread's loads of this chunk before any store over it
        tl.store(p_val + off, v, mask=keep)
        tl.store(p_pos + off, pos, mask=keep)
        tl.debug_barrier()
        total += tl.sum(ki, 0)
    return total


@triton.jit
def _kth_key(x, k, LO_BIT: tl.constexpr):
    """The largest key r (a multiple of 2^LO_BIT) with at least k of the values x (a block in
    registers) at a key >= r: the k-th largest value's key (a key at or below -inf's where fewer
    than k values are above -inf). One bit a step from the top: r ^ 2^b is r + 2^b on the
    key's bit pattern (r's bit b is zero; for b = 31, KEY_MIN + 2^31 = 0), with no int32 add
    that could overflow (a debug build asserts on one)."""
    keys = _key(x)
    r = tl.full((), -2147483648, tl.int32)
    for i in range(0, 32 - LO_BIT):
        cand = r ^ (tl.full((), 1, tl.int32) << (31 - i))
        n = tl.sum((keys >= cand).to(tl.int32), 0)
        r = tl.where(n >= k, cand, r)
    return r


@triton.jit
def _sort_list(p_row, V, p_val, p_pos, n, CAP: tl.constexpr, R: tl.constexpr):
    """Puts the list's n entries in ascending position order (the appends' order is the atomics'):
    each entry's rank is the count of smaller positions ([R, R] comparisons a step: one step for
    a list of at most R), its position stored at CAP + rank in the program's scratch (2 CAP
    entries), then copied back with the value gathered again from the row."""
    o_r = tl.arange(0, R)
    for i0 in range(0, n, R):
        oi = i0 + o_r
        pi = tl.load(p_pos + oi, mask=oi < n, other=2147483647)
        rank = tl.zeros([R], dtype=tl.int32)
        for j0 in range(0, n, R):
            oj = j0 + o_r
            pj = tl.load(p_pos + oj, mask=oj < n, other=2147483647)
            rank += tl.sum((pj[None, :] < pi[:, None]).to(tl.int32), 1)
        tl.store(p_pos + CAP + rank, pi, mask=oi < n)
    tl.debug_barrier()  # every rank's store before the copy's loads
    for i0 in range(0, n, R):
        oi = i0 + o_r
        live = oi < n
        pos = tl.load(p_pos + CAP + oi, mask=live, other=0)
        inb = live & (pos >= 0) & (pos < V)  # (every rank is stored once: a guard, not a case)
        tl.store(p_val + oi, tl.load(p_row + pos, mask=inb, other=float("-inf")).to(tl.float32), mask=live)
        tl.store(p_pos + oi, pos, mask=live)
    tl.debug_barrier()


@triton.jit
def _filter_bound(lanes, delta, top_k, HAS_MINP: tl.constexpr, HAS_TOPK: tl.constexpr, LO_BIT: tl.constexpr):
    """A lower bound L of the row's tau from its lanes' maxima so far (each lane the max of the
    elements it has seen): max(M + T ln min_p, the k-th largest lane max), M their max. Lanes
    that have seen more only raise it, and never past the row's tau."""
    L = tl.full((), float("-inf"), tl.float32)
    if HAS_MINP:
        L = tl.max(lanes, 0) + delta
    if HAS_TOPK:
        lk = _key_value(_kth_key(lanes, top_k, LO_BIT), LO_BIT)
        L = tl.maximum(L, tl.where(lk == lk, lk, float("-inf")))  # a key below -inf's decodes as NaN
    return L


@triton.jit
def _lanes_update(b_x, lanes, nan):
    """Each lane's max over a block (a NaN left out), and whether a lane has seen a NaN."""
    is_nan = b_x != b_x
    return tl.maximum(lanes, tl.where(is_nan, float("-inf"), b_x)), nan | is_nan


@triton.jit
def _append(b_x, o, V, L, full, p_cnt_row, zero, p_val, p_pos, CAP: tl.constexpr):
    """A block's elements >= L appended to the working list (_append_where)."""
    return _append_where((o < V) & (b_x >= L), b_x, o, full, p_cnt_row, zero, p_val, p_pos, CAP)


@triton.jit
def _append_where(sel, b_x, o, full, p_cnt_row, zero, p_val, p_pos, CAP: tl.constexpr):
    """A block's selected elements appended to the working list (the first CAP of the row's)
    through the row's atomic count, with neither a reduction nor a branch; returns the lanes that
    have been handed a slot past the list (they stop counting: the row has overflowed, so a
    loose selection costs at most CAP + BLOCK atomics on the count)."""
    cand = sel & ~full
    slot = tl.atomic_add(p_cnt_row + zero, 1, mask=cand, sem="relaxed")
    put = cand & (slot < CAP)
    tl.store(p_pos + slot, o, mask=put)
    tl.store(p_val + slot, b_x, mask=put)
    return full | (cand & (slot >= CAP))


@triton.jit
def _list_pass(p_row, V, L, p_cnt_row, p_val, p_pos, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Every element of the row >= L appended to the working list (_append)."""
    o_b = tl.arange(0, BLOCK)
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    full = tl.zeros([BLOCK], dtype=tl.int1)
    b_raw = tl.load(p_row + o_b, mask=o_b < V, other=float("-inf"))
    for start in range(0, V, BLOCK):
        o = start + o_b
        b_nraw = tl.load(p_row + o + BLOCK, mask=o + BLOCK < V, other=float("-inf"))
        b_x = b_raw.to(tl.float32)
        b_raw = b_nraw
        full = _append(b_x, o, V, L, full, p_cnt_row, zero, p_val, p_pos, CAP)


@triton.jit
def _filter_tail(p_row, V, p_tau, p_sup_row, row64, p_val, p_pos, cnt, M, has_nan, delta, c, top_k, top_p,
                 HAS_MINP: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, EXACT_SHIFT: tl.constexpr,
                 LO_BIT: tl.constexpr, CAP: tl.constexpr, SUP_CAP: tl.constexpr, CHUNK: tl.constexpr,
                 SORT_R: tl.constexpr, WIDE: tl.constexpr):
    """A filtered row's tau and support list from its working list of cnt entries (every element
    >= the row's bound, so every kept one; more than CAP: overflowed), its max M and whether it
    holds a NaN: the list put in position order, tau found in it (top-k's count search, then
    top-p's mass search over what min-p and top-k kept), the kept positions stored."""
    ok = cnt <= CAP
    tau = tl.full((), float("-inf"), tl.float32)
    if HAS_MINP:
        tau = M + delta  # exact whether or not the list held
    if ok:
        _sort_list(p_row, V, p_val, p_pos, cnt, CAP, SORT_R)
        if HAS_TOPK:
            r = _digit_select(p_val, cnt, top_k, float("-inf"), 0.0, 1.0, False, True, LO_BIT, CHUNK, WIDE)
            # KEY_MIN: fewer than k listed (min-p kept fewer): min-p's tau stands (KEY_MIN would
            # decode as NaN, and whether a max passes a NaN on differs between backends)
            tau = tl.where(r != KEY_MIN, tl.maximum(tau, _key_value(r, LO_BIT)), tau)
        if HAS_TOPP:
            # the probabilities over what min-p and top-k kept (the list's max is the row's)
            m_l = _list_max(p_val, cnt, CHUNK)
            s = _list_sum(p_val, cnt, tau, m_l, c, EXACT_SHIFT, CHUNK)
            r3 = _digit_select(p_val, cnt, top_p * s, tau, m_l, c, True, EXACT_SHIFT, LO_BIT, CHUNK, WIDE)
            # KEY_MIN: no key reaches top_p * s in this sum's rounding (top_p within an ulp
            # of 1): every id the earlier steps kept stays (its key would decode as NaN)
            tau = tl.where((s > 0.0) & (r3 != KEY_MIN), tl.maximum(tau, _key_value(r3, LO_BIT)), tau)
        if has_nan == 0:
            _finish_list(p_tau, p_sup_row, row64, tau, p_val, p_pos, cnt, SUP_CAP, CHUNK)
        else:  # the log-prob ops read a NaN row whole (its NaN is in no list)
            tl.store(p_sup_row, NOT_LISTED)
            tl.store(p_tau + row64, tau)
    else:
        if HAS_TOPK or HAS_TOPP:
            tl.store(p_sup_row, NEEDS_EXACT)
        else:  # min-p alone: tau is exact, the support too large to list
            tl.store(p_sup_row, NOT_LISTED)
            tl.store(p_tau + row64, tau)


@triton.jit
def _sampler_filter_kernel(
    p_x, p_tau, p_sup, p_val, p_pos, p_cnt, p_temp, p_ml,
    row0, n_rows, V, inner_size, stride_outer, stride_inner,
    t_arg,  # float T (a placeholder with T_FROM_PTR)
    min_p_arg,  # T ln(min_p) for a float T, ln(min_p) with T_FROM_PTR
    top_k, top_p,
    HAS_MINP: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, T_FROM_PTR: tl.constexpr,
    EXACT_SHIFT: tl.constexpr, LO_BIT: tl.constexpr, CAP: tl.constexpr, SUP_CAP: tl.constexpr,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, SORT_R: tl.constexpr,
    ONE_PASS: tl.constexpr, WARM: tl.constexpr, SPLIT: tl.constexpr,
):
    """min-p and/or top-k (then top-p over their support) in two streaming passes over each of
    the rows row0 .. n_rows - 1, neither with a reduction or a branch per block; a persistent
    grid, each program with its own working list (p_val: CAP entries, p_pos: 2 CAP) for the rows
    row0 + pid, row0 + pid + grid, ...

    Pass 1 keeps each of the BLOCK lanes' max (lane j: the row's elements j, j + BLOCK, ...).
    Their max is the row's max M; the k-th largest of them is at most the row's k-th largest (k
    lanes hold a value at least that large). So L = max(M + T ln min_p, that k-th largest) is at
    most tau, and pass 2 lists every element >= L, each through an atomic count of the row
    (p_cnt, zeroed by the caller): a few times k of them for top-k, the support itself for
    min-p. The list is put in position order (_sort_list), and tau found in it (_filter_tail).

    ONE_PASS: the lanes' maxima of the first WARM blocks give a first bound, and a single pass
    then keeps the lanes and lists every element >= the bound so far, over segments of WARM,
    WARM, 2 WARM, 4 WARM, ... blocks, raising the bound after each (_filter_bound: never past
    tau, so every element >= tau is listed; about k more listed a segment for top-k). The list
    is then cut to the final bound; should it have overflowed on the early, looser bounds, the
    row is listed again by the two-pass route's second pass with the final bound.

    SPLIT: each row has its own working list (at its place from row0 in p_val [rows, CAP] and
    p_pos [rows, 2 CAP]) and no tail here: the list's count stays in p_cnt, the row's max, NaN
    flag and final bound go into p_ml [rows, 3], and _sampler_filter_tail_kernel's small
    programs cut the list (one pass) and find tau after this kernel, whose programs stream rows
    all along (the tail is a chain of small reductions that leaves a streaming program's memory
    work idle)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t = _temperature(t_arg, p_temp, T_FROM_PTR)
    delta = 0.0
    if HAS_MINP:
        delta = _min_p_shift(t, min_p_arg, T_FROM_PTR)
    c = LOG2E_C / t
    o_b = tl.arange(0, BLOCK)
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    for row in range(row0 + pid, n_rows, nprog):
        row64 = row + tl.zeros((), tl.int64)  # (a Python int in the interpreter)
        p_row = _row_base(p_x, row64, inner_size, stride_outer, stride_inner)
        p_cnt_row = p_cnt + row64
        if SPLIT:  # the row's own list
            p_lv = p_val + (row64 - row0) * CAP
            p_lp = p_pos + (row64 - row0) * (2 * CAP)
        else:  # the program's list: the positions, then their sorted copy
            p_lv = p_val + pid.to(tl.int64) * CAP
            p_lp = p_pos + pid.to(tl.int64) * (2 * CAP)
        lanes = tl.full([BLOCK], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.int1)
        if ONE_PASS:
            for start in range(0, WARM * BLOCK, BLOCK):  # the first bound (these blocks are read again below)
                o = start + o_b
                b_x = tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32)
                lanes, nan = _lanes_update(b_x, lanes, nan)
            L = _filter_bound(lanes, delta, top_k, HAS_MINP, HAS_TOPK, LO_BIT)
            full = tl.zeros([BLOCK], dtype=tl.int1)
            b_raw = tl.load(p_row + o_b, mask=o_b < V, other=float("-inf"))
            # segments of WARM, WARM, 2 WARM, 4 WARM, ... blocks, the bound raised after each (no
            # reduction or branch inside a segment): each lists about as many as the one before
            seg0 = 0
            seg1 = tl.minimum(V, WARM * BLOCK)
            while seg0 < V:
                for start in range(seg0, seg1, BLOCK):
                    o = start + o_b
                    b_nraw = tl.load(p_row + o + BLOCK, mask=o + BLOCK < V, other=float("-inf"))
                    b_x = b_raw.to(tl.float32)
                    b_raw = b_nraw
                    lanes, nan = _lanes_update(b_x, lanes, nan)
                    full = _append(b_x, o, V, L, full, p_cnt_row, zero, p_lv, p_lp, CAP)
                L = _filter_bound(lanes, delta, top_k, HAS_MINP, HAS_TOPK, LO_BIT)
                seg0 = seg1
                seg1 = seg1 + tl.minimum(tl.maximum(seg1, WARM * BLOCK), V - seg1)  # (no int32 overflow)
        else:
            # pass 1: the lanes' maxima (a NaN left out) and whether the row holds a NaN
            b_raw = tl.load(p_row + o_b, mask=o_b < V, other=float("-inf"))
            for start in range(0, V, BLOCK):
                o = start + o_b
                b_nraw = tl.load(p_row + o + BLOCK, mask=o + BLOCK < V, other=float("-inf"))  # the next block in flight
                b_x = b_raw.to(tl.float32)
                b_raw = b_nraw
                lanes, nan = _lanes_update(b_x, lanes, nan)
            L = _filter_bound(lanes, delta, top_k, HAS_MINP, HAS_TOPK, LO_BIT)  # every element >= L is listed
            # pass 2: every element >= L listed
            _list_pass(p_row, V, L, p_cnt_row, p_lv, p_lp, CAP, BLOCK)
        M = tl.max(lanes, 0)
        has_nan = tl.max(nan.to(tl.int32), 0)
        tl.debug_barrier()  # every thread's appends before the count is read
        cnt = tl.atomic_add(p_cnt_row, 0, sem="relaxed")
        if ONE_PASS:
            if cnt <= CAP:
                if not SPLIT:  # (the tail kernel cuts a split row's list)
                    cnt = _compact(p_lv, p_lp, cnt, L, KEY_MIN, CHUNK)  # cut to the final bound
            else:  # listed again with the final bound, as the two-pass route lists
                tl.atomic_xchg(p_cnt_row, 0, sem="relaxed")
                tl.debug_barrier()  # the count reset before any thread's appends
                _list_pass(p_row, V, L, p_cnt_row, p_lv, p_lp, CAP, BLOCK)
                tl.debug_barrier()
                cnt = tl.atomic_add(p_cnt_row, 0, sem="relaxed")
        if SPLIT:  # for the tail kernel (the count is in p_cnt)
            p_ml_row = p_ml + (row64 - row0) * 3
            tl.store(p_ml_row, M)
            tl.store(p_ml_row + 1, has_nan.to(tl.float32))
            tl.store(p_ml_row + 2, L)
        else:
            p_sup_row = p_sup + row64 * (SUP_CAP + 1)
            _filter_tail(p_row, V, p_tau, p_sup_row, row64, p_lv, p_lp, cnt, M, has_nan, delta, c, top_k, top_p,
                         HAS_MINP, HAS_TOPK, HAS_TOPP, EXACT_SHIFT, LO_BIT, CAP, SUP_CAP, CHUNK, SORT_R, False)
        tl.debug_barrier()  # this row's list reads before the next row's appends


@triton.jit
def _sampler_filter_tail_kernel(
    p_x, p_tau, p_sup, p_val, p_pos, p_cnt, p_temp, p_ml,
    row0, V, inner_size, stride_outer, stride_inner, t_arg, min_p_arg, top_k, top_p,
    HAS_MINP: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, T_FROM_PTR: tl.constexpr,
    EXACT_SHIFT: tl.constexpr, LO_BIT: tl.constexpr, CAP: tl.constexpr, SUP_CAP: tl.constexpr,
    CHUNK: tl.constexpr, SORT_R: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """_sampler_filter_kernel's tail for its SPLIT launch: row row0 + pid's tau and support list
    from the row's working list and count (p_cnt), max, NaN flag and final bound (p_ml); ONE_PASS:
    the list is first cut to the final bound (the early bounds listed more)."""
    i = tl.program_id(0).to(tl.int64)
    row64 = row0 + i
    t = _temperature(t_arg, p_temp, T_FROM_PTR)
    delta = 0.0
    if HAS_MINP:
        delta = _min_p_shift(t, min_p_arg, T_FROM_PTR)
    c = LOG2E_C / t
    p_row = _row_base(p_x, row64, inner_size, stride_outer, stride_inner)
    p_lv = p_val + i * CAP
    p_lp = p_pos + i * (2 * CAP)
    cnt = tl.load(p_cnt + row64)
    M = tl.load(p_ml + i * 3)
    has_nan = tl.load(p_ml + i * 3 + 1).to(tl.int32)
    if ONE_PASS:
        if cnt <= CAP:
            cnt = _compact(p_lv, p_lp, cnt, tl.load(p_ml + i * 3 + 2), KEY_MIN, CHUNK)  # cut to the final bound
    _filter_tail(p_row, V, p_tau, p_sup + row64 * (SUP_CAP + 1), row64, p_lv, p_lp, cnt, M, has_nan, delta, c,
                 top_k, top_p, HAS_MINP, HAS_TOPK, HAS_TOPP, EXACT_SHIFT, LO_BIT, CAP, SUP_CAP, CHUNK, SORT_R, True)


@triton.jit
def _list_sum_sq_below(p_val, n, r, m, c, EXACT_SHIFT: tl.constexpr, CHUNK: tl.constexpr):
    """sum of (2^((x - m) c))^2 over the list's n values x with a key < r."""
    o = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for i0 in range(0, n, CHUNK):
        v = tl.load(p_val + i0 + o, mask=i0 + o < n, other=float("-inf"))
        e = tl.exp2(_shifted(v, m, c, EXACT_SHIFT))
        acc += tl.where((i0 + o < n) & (_key(v) < r), e * e, 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _band_block(p_row, o, V, has_hi, hi, m, c, EXACT_SHIFT: tl.constexpr):
    """One block of the top-p band pass: (the logits, their keys, the mass 2^((x - m) c) of those
    above the band (key >= hi, where the band has a top), the in-range lanes under the band's
    top), for either form of the pass to list from."""
    inb = o < V
    b_x = tl.load(p_row + o, mask=inb, other=float("-inf")).to(tl.float32)
    k_x = _key(b_x)
    above = tl.where(has_hi, inb & (k_x >= hi), False)
    e_above = tl.where(above, tl.exp2(_shifted(b_x, m, c, EXACT_SHIFT)), 0.0)
    under = inb & tl.where(has_hi, k_x < hi, True)
    return b_x, k_x, e_above, under


@triton.jit
def _sampler_top_p_kernel(
    p_x, p_tau, p_sup, p_val, p_pos, p_temp, p_cnt,
    n_rows, V, inner_size, stride_outer, stride_inner,
    t_arg, top_p,
    stride_s, n_samples,  # every stride_s-th element is sampled: n_samples of them
    z_band,  # the band's half width in standard errors of the sample's estimate of the mass below the cut
    EXACT_SHIFT: tl.constexpr, T_FROM_PTR: tl.constexpr, LO_BIT: tl.constexpr, CAP: tl.constexpr,
    SUP_CAP: tl.constexpr, BLOCK_V: tl.constexpr, EPT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    APPEND: tl.constexpr, SORT_R: tl.constexpr,
):
    """top-p alone: two passes over each row (statistics with a sample; the band around the
    sample's estimate of the cut). A persistent grid as _sampler_filter_kernel; the sample and
    then the band list use the program's working list.

    The estimate. The cut is where the mass above reaches top_p * s, the mass below (1 - top_p) s,
    with s exact from pass 1. The sample estimates the mass below a value r as stride_s times its
    own mass below r: a sum of many small terms (every term at most the cut's weight), whose
    standard error the sample's own squares estimate. Its mass above r would be no estimate at
    all: the row's few largest terms carry most of it, and a strided sample holds one of them or
    none. The band [lo, hi) spans z_band standard errors (and two cut weights) of that estimate
    either side of the cut's, in sample masses.

    APPEND: the band pass appends the band's elements through the row's atomic count (p_cnt,
    zeroed by the caller), with neither a reduction nor a branch per block (_append_where); a row
    whose band overflows the list goes to the exact kernel, and a listed support (no ids above
    the band, at most SUP_CAP kept) is put in position order after the cut is found (p_pos holds
    2 CAP entries a program then, as the filter's). Else:

    The band pass lists the band's elements. Should the list fill (a row whose top terms carry
    the mass below the cut too, so that the estimate's error spans most of the row), lo is raised
    to the largest key r where the mass above the band seen so far plus the listed mass >= r
    reaches top_p * s (tau >= r), as the filter kernel raises its bound, and the list compacted."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    p_val = p_val + pid.to(tl.int64) * CAP
    p_pos = p_pos + pid.to(tl.int64) * (2 * CAP if APPEND else CAP)  # APPEND: room for _sort_list's copy
    t = _temperature(t_arg, p_temp, T_FROM_PTR)
    c = LOG2E_C / t
    NR: tl.constexpr = BLOCK_V // EPT
    o_r = tl.arange(0, NR)
    o_v = o_r[:, None] * EPT + tl.arange(0, EPT)[None, :]
    first = tl.arange(0, EPT)[None, :] == 0
    o_b = tl.arange(0, BLOCK)
    zero_b = tl.zeros([BLOCK], dtype=tl.int32)
    for row in range(pid, n_rows, nprog):
        row64 = row + tl.zeros((), tl.int64)  # (a Python int in the interpreter)
        p_row = _row_base(p_x, row64, inner_size, stride_outer, stride_inner)
        p_sup_row = p_sup + row64 * (SUP_CAP + 1)
        # pass 1: max m and s = sum 2^((x - m) c) (the forward kernel's tile-row sums), and the
        # sample: the first element of every tile row whose position is a multiple of stride_s
        s_r = tl.zeros([NR], dtype=tl.float32)
        m_r = tl.full([NR], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK_V):
            o = start + o_v
            b_x = tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32)
            m_r, s_r, _ = _forward_update(b_x, c, m_r, s_r, s_r, False, EXACT_SHIFT)
            q = start + o_r * EPT
            head = tl.max(tl.where(first, b_x, float("-inf")), 1)
            tl.store(p_val + q // stride_s, head, mask=(q % stride_s == 0) & (q < V))
        m, s, _ = _forward_combine(m_r, s_r, s_r, c, False, EXACT_SHIFT)
        target = top_p * s
        tl.debug_barrier()
        # the sample's key of the cut: its mass above is its total less the mass below the cut
        # scaled down to the sample (w_tot - (1 - top_p) s / stride_s); then the standard error of
        # its mass below that key, and the band's two ends
        w_tot = _list_sum(p_val, n_samples, float("-inf"), m, c, EXACT_SHIFT, CHUNK)
        t_cut = w_tot - (s - target) / stride_s
        r0 = _digit_select(p_val, n_samples, t_cut, float("-inf"), m, c, True, EXACT_SHIFT, LO_BIT, CHUNK, True)
        # the cut's weight in the sample (the largest, 1, where every sample lies below the cut)
        w_cut = tl.where(t_cut > 0.0, tl.exp2(_shifted(tl.minimum(_key_value(r0, LO_BIT), m), m, c, EXACT_SHIFT)),
                         1.0)
        se = tl.sqrt(_list_sum_sq_below(p_val, n_samples, r0, m, c, EXACT_SHIFT, CHUNK))
        half = z_band * se + 2.0 * w_cut
        has_hi = t_cut - half > 0.0
        hi = _digit_select(p_val, n_samples, t_cut - half, float("-inf"), m, c, True, EXACT_SHIFT, LO_BIT, CHUNK, True)
        lo = _digit_select(p_val, n_samples, t_cut + half, float("-inf"), m, c, True, EXACT_SHIFT, LO_BIT, CHUNK, True)
        lo = tl.where(t_cut + half <= w_tot, lo, KEY_MIN)
        # a band the list cannot hold is no band: lo no lower than the sample's (rank of hi +
        # n_cap)-th largest, n_cap three quarters of the list's capacity in samples (a row whose top
        # terms carry the mass below the cut as well: a cut among the top ids, an estimate of
        # little use)
        n_cap = (CAP // stride_s) * 3 // 4
        rank_hi = tl.where(has_hi, _list_count_ge(p_val, n_samples, hi, CHUNK), 0)
        lo_cap = _digit_select(p_val, n_samples, rank_hi + n_cap, float("-inf"), m, c, False, EXACT_SHIFT, LO_BIT,
                               CHUNK, True)
        lo = tl.where(rank_hi + n_cap <= n_samples, tl.maximum(lo, lo_cap), lo)
        tl.debug_barrier()  # the sample's loads before the band list overwrites it
        # pass 2: the mass above the band (key >= hi), the band [lo, hi) listed (lo raised when
        # the list fills; APPEND: an overflowed list goes to the exact kernel)
        a_acc = tl.zeros([BLOCK], dtype=tl.float32)
        cnt = tl.full((), 0, tl.int32)
        ok = cnt == 0  # the list holds every element of [lo, hi)
        if APPEND:
            p_cnt_row = p_cnt + row64
            full = tl.zeros([BLOCK], dtype=tl.int1)
            for start in range(0, V, BLOCK):
                o = start + o_b
                b_x, k_x, e_above, under = _band_block(p_row, o, V, has_hi, hi, m, c, EXACT_SHIFT)
                a_acc += e_above
                full = _append_where((k_x >= lo) & under, b_x, o, full, p_cnt_row, zero_b, p_val, p_pos, CAP)
            tl.debug_barrier()  # every thread's appends before the count is read
            cnt = tl.atomic_add(p_cnt_row, 0, sem="relaxed")
            ok = cnt <= CAP
            cnt = tl.minimum(cnt, CAP)
        else:
            for start in range(0, V, BLOCK):
                o = start + o_b
                b_x, k_x, e_above, under = _band_block(p_row, o, V, has_hi, hi, m, c, EXACT_SHIFT)
                a_acc += e_above
                band = (k_x >= lo) & under
                n = tl.sum(band.to(tl.int32), 0)
                if ok & (n > 0):
                    if cnt + n > CAP:
                        # tau >= the largest r with (mass above the band so far) + (listed mass >= r)
                        # >= target: raise lo there, keep the list's elements >= lo
                        need = target - tl.sum(a_acc, 0)
                        tl.debug_barrier()  # the appends of every thread before these loads
                        r = _digit_select(p_val, cnt, need, float("-inf"), m, c, True, EXACT_SHIFT, LO_BIT, CHUNK, True)
                        lo = tl.where(need > 0.0, tl.maximum(lo, r), lo)
                        cnt = _compact(p_val, p_pos, cnt, float("-inf"), lo, CHUNK)
                        band = (k_x >= lo) & under
                        n = tl.sum(band.to(tl.int32), 0)
                        ok = (cnt + n <= CAP) & (need > 0.0)
                    if ok:
                        bi = band.to(tl.int32)
                        off = cnt + tl.cumsum(bi, 0) - bi
                        tl.store(p_pos + off, o, mask=band)
                        tl.store(p_val + off, b_x, mask=band)
                        cnt += n
        tl.debug_barrier()
        a = tl.sum(a_acc, 0)
        found = ok & (a < target) & (s > 0.0)
        if found:
            b = _list_sum(p_val, cnt, float("-inf"), m, c, EXACT_SHIFT, CHUNK)
            found = a + b >= target
        r3 = KEY_MIN
        if found:
            r3 = _digit_select(p_val, cnt, target - a, float("-inf"), m, c, True, EXACT_SHIFT, LO_BIT, CHUNK, True)
            # the list's sum above and this search add in different orders: where a + b lands
            # within an ulp of the target the search can come back empty (KEY_MIN, which would
            # decode as a NaN threshold): the exact kernel takes the row
            found = r3 != KEY_MIN
        if found:
            tau = _key_value(r3, LO_BIT)
            if has_hi:  # the ids above the band are kept too and were not listed
                tl.store(p_sup_row, NOT_LISTED)
                tl.store(p_tau + row64, tau)
            elif APPEND:  # the list in the atomics' order: its kept ids put in position order
                kept = _list_count_ge(p_val, cnt, r3, CHUNK)
                if kept <= SUP_CAP:
                    kept = _compact(p_val, p_pos, cnt, float("-inf"), r3, CHUNK)
                    _sort_list(p_row, V, p_val, p_pos, kept, CAP, SORT_R)
                    _finish_list(p_tau, p_sup_row, row64, tau, p_val, p_pos, kept, SUP_CAP, CHUNK)
                else:
                    tl.store(p_sup_row, NOT_LISTED)
                    tl.store(p_tau + row64, tau)
            else:
                _finish_list(p_tau, p_sup_row, row64, tau, p_val, p_pos, cnt, SUP_CAP, CHUNK)
        else:
            tl.store(p_sup_row, NEEDS_EXACT)
        tl.debug_barrier()


@triton.jit
def _row_max(p_row, V, BLOCK: tl.constexpr):
    o_b = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        o = start + o_b
        acc = tl.maximum(acc, tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32))
    return tl.max(acc, 0)


@triton.jit
def _digit_select(p_row, V, target, floor, m, c, MASS: tl.constexpr, EXACT_SHIFT: tl.constexpr,
                  LO_BIT: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """The largest multiple r of 2^(LO_BIT rounded down to 4) with W(r) >= target, where W(r) sums
    over the V values x >= floor at p_row (a row of logits, or a program's working list) with
    key >= r their weight: 1, or (MASS) 2^((x - m) c). Four bits a pass, from the top: a pass
    counts the 16 candidate digits at once (KEY_MIN where even the whole sum falls short). WIDE: each
    thread sums its own elements of the [BLOCK, 16] tile over the blocks and the threads' sums
    are added once a pass (a pass over a whole row or a sample takes hundreds or tens of blocks,
    each reduction across the threads a chain of shuffles and a barrier); else one reduction a
    block (a short list: fewer registers)."""
    NPASS: tl.constexpr = (32 - LO_BIT + 3) // 4
    o_b = tl.arange(0, BLOCK)
    # r ^ (d << shift) is r + (d << shift) on the key's bit pattern (r's bits from shift up to
    # shift + 3 are zero; the top digit flips KEY_MIN's bit), in int32 with no add that could
    # overflow (a debug build asserts on one)
    d = tl.arange(0, 16)
    r = tl.full((), -2147483648, tl.int32)
    for i in range(0, NPASS):
        shift = 28 - 4 * i
        cands = r ^ (d << shift)
        if MASS:
            acc = tl.zeros([16], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK if WIDE else 1, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([16], dtype=tl.int32)
            acc2 = tl.zeros([BLOCK if WIDE else 1, 16], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            o = start + o_b
            b_x = tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32)
            keep = (o < V) & (b_x >= floor)
            if MASS:
                wt = tl.where(keep, tl.exp2(_shifted(b_x, m, c, EXACT_SHIFT)), 0.0)
            else:
                wt = keep.to(tl.int32)
            hit = _key(b_x)[:, None] >= cands[None, :]
            if WIDE:
                acc2 += tl.where(hit, wt[:, None], 0)
            else:
                acc += tl.sum(tl.where(hit, wt[:, None], 0), 0)
        if WIDE:
            acc = tl.sum(acc2, 0)
        best = tl.max(tl.where(acc >= target, d, 0), 0)
        r = r ^ (best << shift)
    return r


@triton.jit
def _sampler_exact_kernel(
    p_x, p_tau, p_sup, p_temp,
    V, inner_size, stride_outer, stride_inner,
    t_arg, min_p_arg, top_k, top_p,
    ALL_ROWS: tl.constexpr, HAS_MINP: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
    EXACT_SHIFT: tl.constexpr, T_FROM_PTR: tl.constexpr, LO_BIT: tl.constexpr, SUP_CAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Every row (ALL_ROWS), or the rows whose count holds NEEDS_EXACT: tau by passes over the
    whole row (max; top-k's count search; the mass over what min-p and top-k kept and top-p's
    mass search), support not listed."""
    row = tl.program_id(0).to(tl.int64)
    p_sup_row = p_sup + row * (SUP_CAP + 1)
    todo = True
    if not ALL_ROWS:
        todo = tl.load(p_sup_row) == NEEDS_EXACT
    if todo:
        p_row = _row_base(p_x, row, inner_size, stride_outer, stride_inner)
        t = _temperature(t_arg, p_temp, T_FROM_PTR)
        c = LOG2E_C / t
        m = 0.0
        if HAS_MINP or HAS_TOPP:
            m = _row_max(p_row, V, BLOCK)
        tau = tl.full((), float("-inf"), tl.float32)
        if HAS_MINP:
            tau = m + _min_p_shift(t, min_p_arg, T_FROM_PTR)
        if HAS_TOPK:
            r = _digit_select(p_row, V, top_k, float("-inf"), m, c, False, EXACT_SHIFT, LO_BIT, BLOCK, True)
            tau = tl.where(r != KEY_MIN, tl.maximum(tau, _key_value(r, LO_BIT)), tau)  # (see _filter_tail)
        if HAS_TOPP:
            o_b = tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                o = start + o_b
                b_x = tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32)
                acc += tl.where((o < V) & (b_x >= tau), tl.exp2(_shifted(b_x, m, c, EXACT_SHIFT)), 0.0)
            s = tl.sum(acc, 0)
            r3 = _digit_select(p_row, V, top_p * s, tau, m, c, True, EXACT_SHIFT, LO_BIT, BLOCK, True)
            # KEY_MIN: no key reaches top_p * s in this sum's rounding (top_p within an ulp of 1):
            # every id the earlier steps kept stays (its key would decode as NaN)
            tau = tl.where((s > 0.0) & (r3 != KEY_MIN), tl.maximum(tau, _key_value(r3, LO_BIT)), tau)
        tl.store(p_tau + row, tau)
        tl.store(p_sup_row, NOT_LISTED)


def lo_bit(dtype) -> int:
    """The low key bits that are zero in logits of this dtype widened to fp32."""
    return {"torch.bfloat16": 16, "torch.float16": 13}.get(str(dtype), 0)


# programs of the persistent kernels per multiprocessor: the top-p kernel's (8 warps each), the
# filter kernel's (4 warps each)
PROGRAMS_PER_SM = 4
FILTER_PROGRAMS_PER_SM = 8
# the top-p band's half width, in standard errors of the sample's mass below the cut
BAND_Z = 3.0


class Config(NamedTuple):
    block: int  # elements per block of the filter (its lanes) and band passes
    cap: int  # a program's working list of the filter's candidates (a power of 2: it is sorted whole)
    cap_p: int  # a program's working list of top-p's sample, then its band
    ept: int  # elements per thread vector in the top-p statistics pass ([block // ept, ept] tiles)
    warps: int
    exact_block: int  # the exact kernel's block ([block, 16] digit counts)
    chunk: int  # the working lists' chunk (their digit counts, sums and compactions)
    programs: int  # the persistent grid's size (0: PROGRAMS_PER_SM per multiprocessor)
    sample: int  # top-p's sample of the row: at most this many elements (at most cap_p)
    filter_warps: int  # the filter kernel's warps
    filter_programs: int  # its persistent grid (0: FILTER_PROGRAMS_PER_SM per multiprocessor)
    sort_r: int  # the filter's list is put in order [sort_r, sort_r] comparisons a step
    warm: int  # the one-pass filter's first bound: from this many blocks (its first segments' length)
    split_rows: int  # the split filter's rows a launch pair (each row's working list: 12 cap bytes)
    tail_warps: int  # the split filter's tail kernel: warps, list chunk, sort tile
    tail_chunk: int
    tail_sort_r: int


def config(elem_size: int, v: int, small: bool) -> Config:
    """The sampler kernels' tiles for logits of elem_size bytes; ``small`` (the small_tiles
    setting): tiles that take every path of the kernels at small V (several blocks, list
    shrinks and overflows, several rows per program)."""
    if small:
        # (32 lanes: one per thread of the filter's warp, so no thread holds another's atomic)
        return Config(block=32, cap=64, cap_p=64, ept=16 // elem_size, warps=1, exact_block=16, chunk=16, programs=3,
                      sample=64, filter_warps=1, filter_programs=3, sort_r=16, warm=2, split_rows=4, tail_warps=1,
                      tail_chunk=16, tail_sort_r=16)
    block = 4096 // elem_size
    return Config(block=block, cap=1024, cap_p=8192, ept=16 // elem_size, warps=8, exact_block=256, chunk=512,
                  programs=0, sample=8192, filter_warps=4, filter_programs=0, sort_r=64, warm=4, split_rows=4096,
                  tail_warps=2, tail_chunk=128, tail_sort_r=32)


def compile_cases():
    """(name, kernel, signature, constexprs, warps) for tests/test_kernels_compile.py."""
    common = {"p_x": "*bf16", "p_tau": "*fp32", "p_sup": "*i32", "p_val": "*fp32", "p_pos": "*i32",
              "p_temp": "*fp32", "n_rows": "i32", "V": "i32", "inner_size": "i32", "stride_outer": "i64",
              "stride_inner": "i64", "t_arg": "fp32"}
    filt = {"p_x": "*bf16", "p_tau": "*fp32", "p_sup": "*i32", "p_val": "*fp32", "p_pos": "*i32", "p_cnt": "*i32",
            "p_temp": "*fp32", "p_ml": "*fp32", "row0": "i32", "n_rows": "i32", "V": "i32", "inner_size": "i32",
            "stride_outer": "i64", "stride_inner": "i64", "t_arg": "fp32", "min_p_arg": "fp32", "top_k": "i32",
            "top_p": "fp32"}
    for mp, tk, tp, tptr, one, split in [(True, False, False, False, False, False),
                                         (False, True, False, False, False, False),
                                         (True, True, True, True, False, False), (True, False, False, False, True, False),
                                         (False, True, False, False, True, False), (True, True, True, True, True, False),
                                         (False, True, False, False, False, True), (True, True, True, True, True, True)]:
        off = {} if split else {"p_ml": None}
        if not tptr:
            off["p_temp"] = None
        yield (f"sampler_filter minp={mp} topk={tk} topp={tp} t_ptr={tptr} one_pass={one} split={split}",
               _sampler_filter_kernel, filt,
               {"HAS_MINP": mp, "HAS_TOPK": tk, "HAS_TOPP": tp, "T_FROM_PTR": tptr, "EXACT_SHIFT": tptr,
                "LO_BIT": 16, "CAP": 1024, "SUP_CAP": 512, "BLOCK": 2048, "CHUNK": 512, "SORT_R": 64,
                "ONE_PASS": one, "WARM": 4, "SPLIT": split, **off}, 4)
    tail = {k: v for k, v in filt.items() if k != "n_rows"}
    for mp, tk, tp, tptr, one in [(False, True, False, False, False), (True, True, True, True, True),
                                  (True, False, False, False, True)]:
        yield (f"sampler_filter_tail minp={mp} topk={tk} topp={tp} t_ptr={tptr} one_pass={one}",
               _sampler_filter_tail_kernel, tail,
               {"HAS_MINP": mp, "HAS_TOPK": tk, "HAS_TOPP": tp, "T_FROM_PTR": tptr, "EXACT_SHIFT": tptr,
                "LO_BIT": 16, "CAP": 1024, "SUP_CAP": 512, "CHUNK": 128, "SORT_R": 32, "ONE_PASS": one,
                **({} if tptr else {"p_temp": None})}, 2)
    topp = dict(common, p_cnt="*i32", top_p="fp32", stride_s="i32", n_samples="i32", z_band="fp32")
    for tptr, append in ((False, False), (True, False), (False, True), (True, True)):
        yield (f"sampler_top_p t_ptr={tptr} append={append}", _sampler_top_p_kernel, topp,
               {"EXACT_SHIFT": tptr, "T_FROM_PTR": tptr, "LO_BIT": 16, "CAP": 8192, "SUP_CAP": 512,
                "BLOCK_V": 2048, "EPT": 8, "BLOCK": 2048, "CHUNK": 512, "APPEND": append, "SORT_R": 64,
                **({} if append else {"p_cnt": None})}, 8)
    exact = {k: v for k, v in common.items() if k not in ("p_val", "p_pos", "n_rows")}
    exact.update(min_p_arg="fp32", top_k="i32", top_p="fp32")
    for every, fp32 in [(True, False), (False, True)]:
        yield (f"sampler_exact all={every} fp32={fp32}", _sampler_exact_kernel, dict(exact, p_x="*fp32") if fp32
               else exact, {"ALL_ROWS": every, "HAS_MINP": True, "HAS_TOPK": True, "HAS_TOPP": True,
                            "EXACT_SHIFT": False, "T_FROM_PTR": fp32, "LO_BIT": 0 if fp32 else 16, "SUP_CAP": 512,
                            "BLOCK": 256}, 4)
