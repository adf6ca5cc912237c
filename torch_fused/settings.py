"""Run-time settings of torch_fused, in one place.

Read a setting as ``torch_fused.settings.current.<name>``; change settings for a block with
``with torch_fused.settings.override(name=value, ...):`` (tests and benchmarks do this; nothing
assigns another module's globals). Where a setting has an environment variable, the variable is
read once, when this module is imported, and gives the starting value. An override holds in its
own thread or asyncio task only (a context variable: other threads keep the process defaults and
their own overrides), and the autograd formulas run a backward under the settings of its forward
call, whichever thread runs it. The one process-wide effect is ``compile_inline_kernels``'s entry
in ``torch.compiler.config.cache_key_tag`` (a torch setting), written while the override holds.

| name | default | environment variable | what it sets |
|---|---|---|---|
| ``compile_inline_kernels`` | True on torch 2.11 and later | ``TORCH_FUSED_COMPILE_INLINE`` (1: on, 0: off) | under torch.compile, CUDA calls of the log-prob ops whose vocabulary size is static (batch and sequence sizes may be symbolic) have their kernel launches traced into the graph (``torch.library.wrap_triton``), so Inductor's generated code launches them with no Python implementation per call; a symbolic vocabulary, and the backward with ``shift=True``, stay opaque op calls. Off: every call stays an opaque op call. Off by default before torch 2.11, where the GPU tests of this path have not run. A value other than the default is added to ``torch.compiler.config.cache_key_tag``, so torch.compile's FX-graph and AOTAutograd caches keep the graphs of the two values apart (Dynamo traces the same graph either way); a function already compiled in the process keeps the path it was compiled with |
| ``direct_launch`` | True | ``TORCH_FUSED_DIRECT_LAUNCH`` (0: off) | eager launches of the log-prob and mask_reduce kernels call the compiled kernel's launcher directly after their first launch per device and pointer alignments (``_library.PlanLaunch``), without Triton's per-call argument binding and cache lookup, most of a launch's host time (figures: docs/BENCHMARKS.md, "Small calls"). Off: every launch goes through ``kernel[grid]`` |
| ``poison`` | False | | fill every fresh op output with NaN (integers: -2**30) before a kernel writes it; the test suite turns it on, so an element a kernel forgets never passes |
| ``sinkgd_graphs`` | True | ``TORCH_FUSED_SINKGD_GRAPHS`` (0: off) | the eager SinkGD step replays its launches from a CUDA graph once the same plan comes back |
| ``sinkgd_branches`` | True | ``TORCH_FUSED_SINKGD_BRANCHES`` (0: off) | in that graph, a pass's launches over different row-width classes run as parallel branches |
| ``sinkgd_sharded_fused`` | True | ``TORCH_FUSED_SINKGD_SHARDED_FUSED`` (0: off) | sharded (DTensor) SinkGD runs the fused kernels on a Triton device; off: the PyTorch-op path |
| ``sinkgd_sharded_compile`` | True | ``TORCH_FUSED_SINKGD_SHARDED_COMPILE`` (0: off) | the PyTorch-op sharded path compiles its chunk functions on CUDA |
| ``lm_head_chunk_bytes`` | {"cuda": 128 MiB, "cpu": 4 MiB} | | the fused lm_head's fp32 logits / d logits chunk budget, per device type |
| ``lm_head_min_cols`` | {"cuda": 2048} | | the fewest vocabulary columns of a cuBLAS-path chunk, per device type |
| ``lm_head_dlogits_min_cols`` | {"cuda": 8192} | | the fewest columns of the fused backward's d logits chunk (fewer passes over d hidden) |
| ``lm_head_fused_gemm`` | {"forward", "backward"} | | the lm_head passes whose GEMM tiles are consumed inside Triton kernels (bf16 / fp16, no softcap); the rest use cuBLAS chunks |
| ``lm_head_tma`` | True | | the fused GEMMs read their operands through TMA on compute capability 9 and later |
| ``lm_head_part_bytes`` | 64 MiB | | the fused forward's tile statistics buffer, at most |
| ``lm_head_support_chunk_bytes`` | {"cuda": 512 MiB, "cpu": 4 MiB} | | the fused lm_head over the sampler's support (``top_k``, ``top_p``, ``min_p``): bytes of its token-row chunk of fp32 logits [rows, V] (whole rows: a row's threshold needs all of its logits), per device type; at least one row |
| ``lm_head_support_listed`` | True | | the fused lm_head with ``top_k`` <= 512: its forward lists each row's kept ids and their logits, and its backward runs from that list (d logits at the listed ids only: a gather-sum of weight rows for d hidden, a sparse product for d weight) without recomputing the logits or any GEMM; a row whose support is not listed (ties past the k-th id, a NaN row) sends the call to the chunked backward. Off: the chunked backward always |
| ``lm_head_batch_invariant`` | False | ``TORCH_FUSED_BATCH_INVARIANT`` (1: on) | the fused lm_head's results for a row do not depend on the other rows of the call (log-probs, entropy, d hidden; d weight and d bias sum over rows and are exempt): the forward's tile statistics are merged per row in a Triton kernel, the d logits kernel adds the ids' gradients in id order, its GEMMs that cuBLAS would run (the d hidden GEMM; the logits GEMMs of fp32 weights or a softcap) run in a Triton GEMM with fixed tiles and no split of the reduction, and its vocabulary chunks have a fixed width (``lm_head_min_cols`` / ``lm_head_dlogits_min_cols``, 128 without one). Off: torch's merge, cuBLAS, and chunks as wide as ``lm_head_chunk_bytes`` allows. float64 always takes cuBLAS. Off by default: it costs about 4x the default head's time on an H100 (``python -m torch_fused.bench --only agreement``, docs/BENCHMARKS.md) |
| ``lm_head_promote`` | False | ``TORCH_FUSED_LM_HEAD_PROMOTE`` (1: on) | the fused lm_head's bf16 / fp16 GEMM tiles add each K step's product (64 deep) to their fp32 sum with a rounded add, instead of accumulating the whole reduction inside the tensor-core instructions, which truncate (kernels/lm_head.py ``_accumulate``); 128-column tiles (kernels/lm_head.py ``PROMOTE_CONFIG``). Off by default: on an H100 it brings the bf16 head's log-prob error from 4.2e-5 to 2.4e-6 (an fp32 head: 4.8e-6) for 22-24% more time (the agreement suite) |
| ``lm_head_epilogue_ids`` | 1 | | the most ids per row (K) whose log-probs and d logits the fused lm_head's GEMM epilogues take themselves (each of a tile's programs then looks at each of its rows' K ids); with more (a top-k teacher's k ids in ``linear_distill``, a K-ids ``index``), the epilogues make the rows' statistics and dense d logits alone, and a side kernel (kernels/lm_head.py ``_ids_kernel``) computes each id's logit as one row of hidden against one weight row: its log-prob in the forward, its d logit written into the backward's chunk. The routes differ by the rounding of the ids' logits: the side kernel sums each in fp32 with rounded adds, the GEMM's tensor-core accumulation truncates (about 4e-5 in a log-prob without ``lm_head_promote``); 1 keeps the measured single-id head on its epilogue route |
| ``distill_chunk_bytes`` | {"cuda": 1 GiB, "cpu": 4 MiB} | | the distillation head's token-row chunk: bytes of both models' fp32 logits [rows, V], per device type; at most N / 32 rows (the two chunks within 1/16 of one [N, V] fp32 logits tensor), at least ``distill_min_rows``. On CUDA the N / 32 bound is what binds at the benchmark shapes: fewer rows make the logits GEMMs re-read both heads' weights more often (on an H100 at N 8192, V 151936: 208-row chunks with 832-row groups 1.99x the four bare GEMMs, 256 with 1024 (this default) 1.73x, reduced mode; tools/distill_chunks.py) |
| ``distill_group_bytes`` | {"cuda": 512 MiB, "cpu": 4 MiB} | | the distillation head's d logits group: bytes of the student weight's-dtype d logits of whole chunks that one d hidden and one d weight GEMM take, per device type; within 1/16 of one [N, V] fp32 logits tensor |
| ``distill_max_extra`` | {"cuda": 0.125} | | per device type, the most extra memory of the distillation head's chunk and group buffers, as a fraction of one [N, V] fp32 logits tensor (half of it each; ``distill_min_rows`` wins over it below 32 times its rows); a device type not named: the byte budgets alone |
| ``distill_segment`` | 4096 | | the distillation row passes split each row into segments of at least this many columns (one program each) where the rows alone would not fill the device (the head's chunks); 0: one program per row |
| ``distill_min_rows`` | {"cuda": 128} | | the fewest token rows of a distillation head chunk, per device type (fewer rows re-read both heads' weights per chunk) |
| ``distill_vocab_min_cols`` | {"cuda": 2048} | | the distillation head's backward from saved statistics (reduction "none") runs over vocabulary chunks of every row, with no fp32 [V, H] d weight accumulator, where its row chunks would keep one and its budgets (``distill_chunk_bytes``, ``distill_group_bytes``, ``distill_max_extra`` less the fp32 d hidden rows) give at least this many columns per chunk, per device type (a device type not named: 1); fewer columns make each chunk's read and write of the d hidden rows weigh more (ops/distill.py ``vocab_plan``) |
| ``logprobs_bwd_segment`` | 32768 | | the log-prob backward splits a row into programs of about this many columns (0: one program per row) |
| ``sampler_kernels`` | True | ``TORCH_FUSED_SAMPLER_KERNELS`` (0: off) | the thresholds of the sampler's support (top_k, top_p, min_p of the log-prob ops and of the fused head, whose list of kept ids with top_k comes from them too) come from the Triton kernels of kernels/sampler.py on CUDA (the rule's thresholds on rows of finite and -inf logits; a row with a NaN or +inf logit may be cut elsewhere, its in-support log-probs NaN either way; on an H100 1.6x to 29x faster than the rule, docs/BENCHMARKS.md "Over the sampler's support"); off: from the plain-PyTorch rule on the device (reference.sampler_threshold: a per-row top-k / sort, [rows, V] temporaries). CPU and float64 logits always take the rule |
| ``sampler_filter_one_pass`` | False | | the sampler's min-p / top-k filter kernel (kernels/sampler.py ``_sampler_filter_kernel``) reads each row once, listing candidates against a bound it raises after segments of doubling length (a row whose list overflows on the early bounds is listed again); off: two passes, the bound from the first. The same thresholds and lists either way; ``python tools/sampler_sweep.py`` times both |
| ``sampler_filter_split`` | False | | the filter kernel leaves each row's tail (its list put in order, tau found in it, the support list stored: a chain of small reductions) to a second kernel of one small program per row, in launch pairs over rows of at most 4096 (each row's working list, 12 KiB, lives between the two); off: each streaming program runs its rows' tails itself. The same thresholds and lists either way; ``python tools/sampler_sweep.py`` times both |
| ``sampler_top_p_append`` | False | | the top-p kernel's band pass (kernels/sampler.py ``_sampler_top_p_kernel``) appends the band's ids through an atomic count, with neither a reduction nor a branch per block, and sends a row whose band overflows its list to the exact kernel; off: each block's band is counted and listed in order, the band narrowed when the list fills. The rule's thresholds either way (a cut within fp32 rounding of top_p may land an id apart: the band's sums run in another order); ``python tools/sampler_routes.py`` and ``python tools/sampler_sweep.py`` time both |
| ``sampler_exact`` | False | | the sampler's support (top_k, top_p, min_p of the log-prob ops) by the exact multi-pass kernel for every row instead of the fast routes (kernels/sampler.py): tests and benchmarks |
| ``sampler_rule_chunk_bytes`` | {"cuda": 256 MiB} | | the plain-PyTorch rule of the sampler's support (``sampler_kernels`` off; reference.sampler_threshold) on a device type it names works in chunks of rows of about this many bytes of fp32 ``[rows, V]`` (its top-k, sort and cumsum temporaries are a few of these); elsewhere in ``reference_chunk_elems`` chunks. A chunk of a few rows leaves the GPU's top-k and sort nearly idle |
| ``reference_chunk_elems`` | 2**21 | | the plain-PyTorch implementations (CPU) work in chunks of rows whose float temporaries stay near this many elements |
| ``small_tiles`` | False | | every kernel takes its smallest tiles, which still take every code path (full blocks, masked tails, several programs and trips) at small shapes: the interpreter test run |
| ``logprobs_block`` | None | | (BLOCK_V, num_warps) of every log-prob launch instead of the shipped choice (kernels/logprobs.py pick_block): the block sweep |
| ``mask_reduce_tiles`` | None | | a full replacement of kernels/mask_reduce.py ``TILES``: the tile sweep |
| ``lm_head_tiles`` | None | | a full replacement of kernels/lm_head.py ``CONFIG`` (tiles per kernel): the GEMM-path sweep |
| ``sinkgd_tiles`` | None | | a kernels/sinkgd.py ``Tiles`` instead of the shipped one (a plan keeps the tiles it was built with and is keyed by them) |
| ``bench_sinkgd_compile`` | True | ``TORCH_FUSED_BENCH_SINKGD_COMPILE`` (0: off) | the sinkgd benchmark also times the torch.compile'd formula (slow to compile) |

Fixed for the process (not settings: read once at import, no override): ``INTERPRET``, from
Triton's own ``TRITON_INTERPRET`` (1: every Triton kernel runs in Triton's interpreter, and the
package registers its Triton implementations for CPU tensors too; it must be set before
torch_fused is imported).

The tile settings replace the shipped tables of the kernel modules (their constants, which the
code never reassigns); None keeps them.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from types import MappingProxyType

import torch

__all__ = ["current", "override", "DEFAULTS", "values", "snapshot", "restored"]


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value != "0"


def torch_release(version: str) -> tuple[int, ...] | None:
    """(major, minor) of a torch version string ("2.11.0+cu130" -> (2, 11)); None where it does not
    parse (an unusual local build string); a bare "2" gives (2,). The one parse of the version for the import warning
    (torch_fused/__init__.py) and the version-dependent defaults here."""
    try:
        return tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None


def _torch_at_least(major: int, minor: int) -> bool:
    release = torch_release(torch.__version__)
    return release is not None and release >= (major, minor)


# TRITON_INTERPRET=1 (Triton's own variable, read here once, at import): the Triton kernels run
# in Triton's interpreter and serve CPU tensors too. Fixed for the process: Triton reads the
# variable when a kernel is decorated, so no override can change it.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# compile_inline_kernels without its environment variable: on where the GPU tests of the path ran
_INLINE_DEFAULT = _torch_at_least(2, 11)

DEFAULTS = dict(
    compile_inline_kernels=_env_flag("TORCH_FUSED_COMPILE_INLINE", _INLINE_DEFAULT),
    direct_launch=_env_flag("TORCH_FUSED_DIRECT_LAUNCH", True),
    poison=False,
    sinkgd_graphs=_env_flag("TORCH_FUSED_SINKGD_GRAPHS", True),
    sinkgd_branches=_env_flag("TORCH_FUSED_SINKGD_BRANCHES", True),
    sinkgd_sharded_fused=_env_flag("TORCH_FUSED_SINKGD_SHARDED_FUSED", True),
    sinkgd_sharded_compile=_env_flag("TORCH_FUSED_SINKGD_SHARDED_COMPILE", True),
    lm_head_chunk_bytes={"cuda": 128 << 20, "cpu": 4 << 20},
    lm_head_min_cols={"cuda": 2048},
    lm_head_dlogits_min_cols={"cuda": 8192},
    lm_head_fused_gemm=frozenset({"forward", "backward"}),
    lm_head_tma=True,
    lm_head_part_bytes=64 << 20,
    lm_head_support_chunk_bytes={"cuda": 512 << 20, "cpu": 4 << 20},
    lm_head_support_listed=True,
    lm_head_batch_invariant=_env_flag("TORCH_FUSED_BATCH_INVARIANT", False),
    lm_head_promote=_env_flag("TORCH_FUSED_LM_HEAD_PROMOTE", False),
    lm_head_epilogue_ids=1,
    distill_chunk_bytes={"cuda": 1 << 30, "cpu": 4 << 20},
    distill_group_bytes={"cuda": 512 << 20, "cpu": 4 << 20},
    distill_max_extra={"cuda": 0.125},
    distill_min_rows={"cuda": 128},
    distill_vocab_min_cols={"cuda": 2048},
    distill_segment=4096,
    logprobs_bwd_segment=32768,
    sampler_kernels=_env_flag("TORCH_FUSED_SAMPLER_KERNELS", True),
    sampler_exact=False,
    sampler_filter_one_pass=False,
    sampler_filter_split=False,
    sampler_top_p_append=False,
    sampler_rule_chunk_bytes={"cuda": 256 << 20},
    reference_chunk_elems=1 << 21,
    small_tiles=False,
    logprobs_block=None,
    mask_reduce_tiles=None,
    lm_head_tiles=None,
    sinkgd_tiles=None,
    bench_sinkgd_compile=_env_flag("TORCH_FUSED_BENCH_SINKGD_COMPILE", True),
)


class _FrozenDict(dict):
    """A dict-valued setting as stored: a copy that refuses changes (still a dict for the code that
    reads it), so that neither the dict given to override nor one read back through ``current``
    can change a setting."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a torch_fused setting is read-only: change it with torch_fused.settings.override(...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):  # pickles (and deep-copies) as a plain dict
        return dict, (dict(self),)


def _frozen(value):
    return _FrozenDict(value) if isinstance(value, dict) else value


# The process defaults, and the values in effect in this thread / asyncio task: a context
# variable, so that an override in one thread or task is never seen by another, and each block
# restores exactly the values it found.
_DEFAULT_VALUES = MappingProxyType({k: _frozen(v) for k, v in DEFAULTS.items()})
_VALUES: contextvars.ContextVar = contextvars.ContextVar("torch_fused_settings", default=_DEFAULT_VALUES)


def values():
    """The settings in effect here (a read-only mapping of name -> value): the process defaults
    with this thread's or task's overrides on top. The per-call paths of small ops index it
    directly (an attribute of ``current`` costs more)."""
    return _VALUES.get()


class _Settings:
    """The current values (this thread's or task's); attribute access by name. Unknown names raise
    AttributeError. A dict-valued setting reads as a read-only dict: change it with override."""

    __slots__ = ()

    def __getattr__(self, name):
        try:
            return _VALUES.get()[name]
        except KeyError:
            raise AttributeError(f"torch_fused.settings has no setting {name!r}; the settings: "
                                 f"{', '.join(sorted(DEFAULTS))}") from None

    def __setattr__(self, name, value):
        raise AttributeError("set torch_fused settings with torch_fused.settings.override(...)")

    def as_dict(self) -> dict:
        """A copy of the values in effect here (dict-valued settings as plain dicts)."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in _VALUES.get().items()}


current = _Settings()


def snapshot():
    """The values in effect here, to be reinstated elsewhere with ``restored``: the autograd
    formulas keep their forward's settings for the backward, which may run on another thread
    (CUDA's autograd worker threads start without this thread's overrides)."""
    return _VALUES.get()


@contextlib.contextmanager
def restored(snap):
    """``with restored(snapshot())``: exactly those values for the block (this thread or task)."""
    if snap is _VALUES.get():
        yield
        return
    token = _VALUES.set(snap)
    try:
        yield
    finally:
        _VALUES.reset(token)


_CACHE_TAG = "torch_fused:compile_inline_kernels="
_SCHEMAS_TAG = "torch_fused:schemas="
_schemas_fingerprint: str | None = None


def schemas_fingerprint() -> str:
    """A short hash of every registered ``fused::`` op's schema (names, arguments, defaults)."""
    import hashlib

    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused::"))
    text = "\n".join(str(torch._C._get_schema(n, "")) for n in names)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def key_compile_caches_by_schemas() -> None:
    """Puts the ops' schema fingerprint into torch.compile's cache tag (called once the package
    has registered its ops). The caches (FX graph, AOTAutograd) key a graph by what Dynamo traced:
    a public op's call that did not change would otherwise fetch a graph compiled against an
    earlier release's core-op schema (one argument fewer, say) and fail at its first call."""
    global _schemas_fingerprint
    _schemas_fingerprint = schemas_fingerprint()
    _sync_compile_cache_tag()


def _sync_compile_cache_tag() -> None:
    """torch.compile's caches (FX graph, AOTAutograd) key a graph by what Dynamo traced, which
    does not show whether the log-prob launches were inlined (compile_inline_kernels): a graph
    cached under the other value would be reused. Where the setting differs from its default,
    torch.compiler.config.cache_key_tag carries it (appended to the user's own tag), so such
    graphs are cached apart. The tag also carries the ops' schema fingerprint
    (key_compile_caches_by_schemas), after the user's own tag."""
    cfg = getattr(torch.compiler, "config", None)
    tag = getattr(cfg, "cache_key_tag", None)
    if not isinstance(tag, str):  # pragma: no cover - torch without the tag
        return
    parts = [p for p in tag.split("|") if p and not p.startswith((_CACHE_TAG, _SCHEMAS_TAG))]
    if _schemas_fingerprint is not None:
        parts.append(_SCHEMAS_TAG + _schemas_fingerprint)
    if values()["compile_inline_kernels"] != _INLINE_DEFAULT:
        parts.append(_CACHE_TAG + str(int(bool(values()["compile_inline_kernels"]))))
    new = "|".join(parts)
    if new != tag:
        cfg.cache_key_tag = new


_sync_compile_cache_tag()


@contextlib.contextmanager
def override(**values):
    """``with override(name=value, ...)``: the settings for the block, in this thread or asyncio
    task only (others keep theirs), restored exactly after it (also when it raises). Names are
    checked: a misspelt setting raises instead of doing nothing. A dict value is copied: changing
    the dict afterwards does not change the setting."""
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"override: unknown setting(s) {unknown}; the settings: {', '.join(sorted(DEFAULTS))}")
    new = dict(_VALUES.get())
    new.update((k, _frozen(v)) for k, v in values.items())
    token = _VALUES.set(MappingProxyType(new))
    if "compile_inline_kernels" in values:
        _sync_compile_cache_tag()
    try:
        yield current
    finally:
        _VALUES.reset(token)
        if "compile_inline_kernels" in values:
            _sync_compile_cache_tag()
