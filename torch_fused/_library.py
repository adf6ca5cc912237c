"""The ``fused`` op namespace and the small helpers every op shares.

Kernel devices: Triton implementations are registered for CUDA. When the process runs with
``TRITON_INTERPRET=1`` (set before this package is imported), they are registered for CPU
tensors as well, so that the CPU test job runs whole ops through the real kernels in
Triton's interpreter instead of the plain-PyTorch reference.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

import torch
from torch.autograd import forward_ad as _forward_ad

NAMESPACE = "fused"

# One Library object for the ops defined with the low-level API (the composite public ops);
# custom_op ops register themselves under the same namespace.
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

from .settings import INTERPRET  # noqa: E402  (TRITON_INTERPRET, read once at import: settings.py)

try:  # triton is a Linux-only dependency; the CPU reference path works without it
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without triton
    HAS_TRITON = False

# Devices whose tensors go through the Triton kernels.
TRITON_DEVICES: tuple[str, ...] = (("cuda", "cpu") if INTERPRET else ("cuda",)) if HAS_TRITON else ()
_TRITON_CUDA, _TRITON_CPU = "cuda" in TRITON_DEVICES, "cpu" in TRITON_DEVICES


def on_triton(t: torch.Tensor) -> bool:
    """Whether t's device takes the Triton implementations (``t.device.type in TRITON_DEVICES``),
    from the tensor's flags: no torch.device object made per call (the eager fast paths)."""
    return (_TRITON_CUDA and t.is_cuda) or (_TRITON_CPU and t.is_cpu)


def check(cond, message) -> None:
    """``torch._check`` with a fast path: a plain ``True`` costs one comparison.

    ``cond`` may be a SymBool while tracing (then torch._check records the guard); ``message``
    is a zero-argument callable that names the argument, the expectation and the actual value.
    Raises RuntimeError, in eager and compiled calls alike.
    """
    if cond is True:
        return
    if cond is False:  # a Python bool: raise here, as torch._check would (Dynamo re-raises it)
        raise RuntimeError(message())
    if torch.compiler.is_dynamo_compiling():
        # traced by Dynamo itself (the DTensor paths' checks of global shapes; the single-device
        # ops check inside their fake implementations, which Dynamo does not trace): a message
        # closure over tensors cannot go into torch._check there. The condition is decided on
        # the symbolic shapes instead (a guard on it: inputs that break it recompile, and raise).
        # A condition on unbacked (data-dependent) sizes cannot be guarded: it becomes a runtime
        # assert of the graph (torch._check without the message) instead of an error at trace time
        if not _guard_or_true(cond):
            raise RuntimeError(message())
        torch._check(cond)
        return
    torch._check(cond, message)


def _guard_or_true(cond) -> bool:
    """cond decided with a guard where its sizes are backed; True where it cannot be decided
    without the data (unbacked sizes): the caller then leaves it to a runtime assert."""
    try:
        from torch.fx.experimental.symbolic_shapes import guard_or_true
    except ImportError:  # pragma: no cover - a torch without it decides with a guard
        return bool(cond)
    return guard_or_true(cond)


def check_value(cond, message) -> None:
    """``check`` raising ValueError (``torch._check_value``): the SinkGD step's and optimizer's
    input checks, on one device and sharded alike."""
    if cond is True:
        return
    if cond is False:
        raise ValueError(message())
    if torch.compiler.is_dynamo_compiling():  # as in check
        if not _guard_or_true(cond):
            raise ValueError(message())
        torch._check(cond)
        return
    torch._check_value(cond, message)


def is_dtensor(t) -> bool:
    """Whether t is a DTensor, without importing torch.distributed.tensor (a slow import) for plain
    tensors and parameters: none can exist before that module is imported."""
    if t is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def no_forward_mode(name: str, *tensors) -> None:
    """Raises NotImplementedError where ``name`` (a public op) would be differentiated in forward
    mode or by a functorch transform of reverse mode, through one of ``tensors`` (its
    differentiable inputs, or None): a tensor with a forward-AD tangent, or one wrapped at the
    level of a torch.func.jvp / grad / vjp transform on top of the stack. The ops have
    reverse-mode autograd formulas only: forward mode would drop the tangent silently and
    torch.func.grad failed inside torch.library. Inputs that are constants of the transform
    (not wrapped at its level, no tangent) pass."""
    interp = torch._C._functorch.peek_interpreter_stack()
    kind = None if interp is None else interp.key()
    # (a transform lifts every input to its level: what tells a differentiated one from a
    # constant is its requires_grad (grad, vjp) or its tangent (jvp, forward_ad))
    hit = kind == torch._C._functorch.TransformType.Grad and any(t is not None and t.requires_grad for t in tensors)
    if not hit and (kind == torch._C._functorch.TransformType.Jvp or _forward_ad._current_level >= 0):
        hit = any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    if hit:
        raise NotImplementedError(
            f"{name}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) and functorch's reverse mode "
            "(torch.func.grad, vjp, jacrev) are not supported through the op's inputs (it has a reverse-mode "
            "autograd formula only): differentiate with torch.autograd.grad or .backward(); torch.func.vmap works")


def eager_eligible(*tensors) -> bool:
    """Whether a public function may take its eager fast path (the op's implementations and
    autograd formula without the dispatcher; ops/logprobs.py, "Eager fast path") for these
    arguments (tensors or None): not while Dynamo traces, under a dispatch or torch-function
    mode, in a functorch transform, jit tracing or a forward-mode AD level, and only for plain
    tensors."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return False
    return not (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack() is not None or torch._C._get_tracing_state()
                or _forward_ad._current_level >= 0)


def call_eager(name: str, needs_grad, function, implementation, *args):
    """An eager fast path's call: ``function`` (its autograd.Function's apply) where a gradient can
    flow (grad mode on and a tensor of ``needs_grad`` requiring grad), else ``implementation``
    alone; under the profiler, in a record named ``name`` (the op's), so traces keep the op."""
    fn = function if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in needs_grad) \
        else implementation
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.autograd.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


# A nominal multiprocessor count for grids sized off a GPU (the interpreter) and for the kernels'
# ahead-of-time signature lists: an H100 / H200's.
NOMINAL_SMS = 132
# SinkGD: every row and column scale is clamped here, so a (near-)zero row or column, whose scale
# grows by sqrt(n) / eps per iteration, never overflows into inf * 0 = NaN; and a clamp whose
# square stays finite in fp32 (about sqrt(fp32 max)) for the squared scales.
SCALE_MAX = 1e30
SQRT_FP32_MAX = 1.8e19
# SinkGD stochastic rounding: the Philox seed of a matrix is step * SR_SEED_STRIDE + its salt
# (larger than any salt: no two (step, matrix) pairs share a seed in a list of fewer matrices).
SR_SEED_STRIDE = 1000003


@functools.lru_cache(maxsize=None)
def n_sm(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (sizes grids); NOMINAL_SMS elsewhere (interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SMS


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation / output dtype of the reduction ops: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def rows_strides(x: torch.Tensor) -> tuple[int, int, int] | None:
    """Describe the leading dims of ``x`` (all but the last) as at most two strided dims.

    Returns ``(inner_size, outer_stride, inner_stride)`` such that row ``r`` of the flattened
    leading dims starts at element offset ``(r // inner_size) * outer_stride +
    (r % inner_size) * inner_stride``, or ``None`` when the leading dims don't collapse to two
    (the caller then copies); ``(1, 0, 0)`` for a tensor with no rows. Adjacent dims merge when they are contiguous with each other;
    size-1 dims are dropped. So ``x[:, :-1]`` of a ``[B, L+1, V]`` tensor and transposed
    leading dims are described without a copy.
    """
    dims = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
    merged: list[list[int]] = []
    for size, stride in dims:
        if merged and merged[-1][1] == stride * size:
            merged[-1][0] *= size
            merged[-1][1] = stride
        else:
            merged.append([size, stride])
    if not merged:
        return 1, 0, 0
    if len(merged) == 1:
        return merged[0][0], 0, merged[0][1]
    if len(merged) == 2:
        return merged[1][0], merged[0][1], merged[1][1]
    if any(size == 0 for size, _ in merged):  # no rows: any description serves (nothing is read or written)
        return 1, 0, 0
    return None


# Temperatures act within [T_MIN, T_MAX]: a value outside (positive and finite, as checked) acts as
# the nearer end. There the results equal their limits (one-hot / uniform) to fp32 accuracy for
# logits up to about 1e4 apart, and the kernels' scale log2(e) / T stays a normal fp32 number
# (past about 1e38 it became inf or subnormal: NaN outputs).
T_MIN = 2.0**-100
T_MAX = 2.0**100


def kernel_temperature(t: float) -> float:
    """The temperature the kernels and the reference use for a checked float ``t``."""
    # the bounds as literals (T_MIN, T_MAX): see traced_constants
    return min(max(t, 2.0**-100), 2.0**100)


# The GPU kernels shift a row's logits as fma(x, c, -round(m c)) (c = log2(e) / T, m the row
# max): one instruction, and every term of the row carries the same rounding offset of m c, which
# cancels in the log-softmax. That offset is up to half an ulp of m c: past |m c| of about 2^30 it
# overflows exp2. Where c is large (T below log2(e) / FMA_SHIFT_MAX_C, about 1.4e-3) or unknown on
# the host (a tensor temperature), the kernels shift exactly, (x - m) c, instead.
FMA_SHIFT_MAX_C = 1024.0


def exact_shift(c: float | None) -> bool:
    """Whether the logits kernels shift exactly (EXACT_SHIFT) for the scale c (None: a tensor
    temperature, read on the device); always in the interpreter."""
    return INTERPRET or c is None or c > 1024.0  # FMA_SHIFT_MAX_C as a literal: see traced_constants


LOG2E = 1.4426950408889634  # log2(e): the kernels work in base 2
LN2 = 0.6931471805599453  # ln(2): back to nats


def traced_constants() -> tuple[float, float]:
    """(LOG2E, LN2) as literals, for code that Dynamo traces itself (the vocabulary-parallel
    paths; the ops' implementations are not traced by it). With dynamic=True Dynamo turns a float
    read from a module global into a symbolic float of the graph; one first read inside an
    autograd.Function's forward cannot be used in a second one (torch 2.14: "lift_tracked_freevar_
    to_input should not be called on root SubgraphTracer"), which would stop two vocabulary-
    parallel calls in one dynamic graph. A function's literals stay constants. kernel_temperature and
    exact_shift write theirs inline for the same reason."""
    return 1.4426950408889634, 0.6931471805599453


assert traced_constants() == (LOG2E, LN2) and FMA_SHIFT_MAX_C == 1024.0 and (T_MIN, T_MAX) == (2.0**-100, 2.0**100)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative Python ints (host side; no Triton call path)."""
    return -(-a // b)


from .settings import current as _settings, values as _settings_values  # noqa: E402
from .settings import restored as _settings_restored, snapshot as _settings_snapshot  # noqa: E402


def under_forward_settings(setup_context, backward):
    """(setup_context, backward) of an autograd formula whose backward runs under the settings in
    effect at its forward call (settings.snapshot): on CUDA the autograd engine runs a backward
    on its own worker thread, which sees none of the caller's overrides."""
    def setup(ctx, inputs, output):
        ctx.settings = _settings_snapshot()
        setup_context(ctx, inputs, output)

    def run_backward(ctx, *grads):
        with _settings_restored(ctx.settings):
            return backward(ctx, *grads)

    return setup, run_backward


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _settings_values()["poison"]:  # settings.poison: the test suite's NaN fill of fresh outputs
        out.fill_(float("nan") if dtype.is_floating_point else -(2**30))
    return out


class Plans(dict):
    """Launch plans by call key (shapes, strides, dtypes and the scalar arguments): what
    the checks and the layout arithmetic of a call made of those inputs concluded, so that a
    repeated call (a training loop's) does neither again. Bounded: cleared past MAX entries. A
    key with symbolic sizes (a call traced with dynamic shapes) is not hashable: such a plan is
    made afresh and not kept (``get``)."""
    MAX = 1024

    def get(self, key):
        try:
            return dict.get(self, key)
        except TypeError:  # unhashable: symbolic sizes
            return None

    def put(self, key, plan):
        try:
            hash(key)
        except TypeError:
            return plan
        if len(self) >= self.MAX:
            self.clear()
        self[key] = plan
        return plan


def tensor_key(t):
    """(shape, strides, dtype) of t, None for None: a plan key's part for one tensor (no device: the
    log-prob plans hold no device-dependent choice; a plan that does keys the device itself)."""
    return None if t is None else (t.shape, t.stride(), t.dtype)


# ---------------------------------------------------------------------------------------------
# Kernel launches a compiler can see (settings.compile_inline_kernels)

class _InlineState(threading.local):
    active = False  # inline_under_compile is tracing an implementation in this thread


_INLINE = _InlineState()


def launch(kernel):
    """``kernel``, to launch as ``launch(kernel)[grid](...)``; while inline_under_compile traces an
    op's implementation, the kernel wrapped by ``torch.library.wrap_triton``, so the traced graph
    holds the launch itself. A launch passes None for the pointer arguments it does not touch (a
    constexpr turns their loads and stores off; Triton makes a None argument a compile-time
    constant), never another tensor: a traced launch must not pass one tensor for two pointer
    arguments of which the kernel may write one, because the functional graph gives each argument
    the kernel may write its own copy, and the copy of the last such argument replaces the tensor,
    whichever copy the kernel wrote (so the output would be the unwritten copy)."""
    if _INLINE.active:
        return torch.library.wrap_triton(kernel)
    return kernel


def _hook_set(hook) -> bool:
    """None, or a HookChain (newer Triton) with no hook in it: not set."""
    return hook is not None and bool(getattr(hook, "calls", True))


# where Triton keeps its launch hooks: triton.knobs.runtime (newer Triton) or CompiledKernel
_HOOKS = ((triton.knobs.runtime if getattr(triton, "knobs", None) is not None else triton.compiler.CompiledKernel)
          if HAS_TRITON else None)


def _launch_hooks_set() -> bool:
    """Whether Triton's launch enter/exit hooks are set (a profiler such as proton): a direct
    launch would skip them."""
    return (_hook_set(getattr(_HOOKS, "launch_enter_hook", None))
            or _hook_set(getattr(_HOOKS, "launch_exit_hook", None)))


class PlanLaunch:
    """One kernel's launch with a launch plan's constexprs (and num_warps), for the calls of that
    plan. The integer and float arguments of a plan's launch are fixed by the plan's key (shapes,
    strides, dtypes, scalar arguments), so what Triton specializes a compiled kernel on can vary
    between its calls only by each pointer's 16-byte alignment and by the current device. With
    ``settings.direct_launch`` the first call per (device, pointer alignments) goes through
    ``kernel[grid]`` and keeps the compiled kernel; later ones call its launcher directly, without
    Triton's per-call argument binding and cache lookup, most of a launch's host time (figures:
    docs/BENCHMARKS.md, "Small calls"). Traced launches (inline_under_compile), the interpreter
    and set launch hooks always take ``kernel[grid]``."""

    __slots__ = ("kernel", "constexprs", "tail_names", "compiled", "tensor_slots", "interpret")

    def __init__(self, kernel, constexprs: dict, *, interpret: bool = INTERPRET):
        self.kernel = kernel
        # the kernel runs in Triton's interpreter (always through kernel[grid]): fixed per process
        # (settings.INTERPRET), an argument so that the direct path can be tested anywhere
        self.interpret = interpret
        self.constexprs = constexprs  # the constexpr parameters (by keyword) and launch options
        # a direct launch passes every parameter positionally: the constexpr ones, which the plan
        # passes by keyword, must be the signature's last
        self.tail_names = tuple(n for n in kernel.arg_names if n in constexprs)
        if tuple(kernel.arg_names[len(kernel.arg_names) - len(self.tail_names):]) != self.tail_names:
            raise ValueError(f"PlanLaunch: the keyword parameters {self.tail_names} of {kernel.arg_names} "
                             "are not the signature's last")
        self.compiled = {}
        # the positions of the tensor arguments, from the first call: a PlanLaunch is one plan's,
        # and a plan's key fixes which pointer arguments are tensors and which None
        self.tensor_slots = None

    def __call__(self, grid: int, *args) -> None:
        if _INLINE.active or self.interpret or not _settings_values()["direct_launch"] or _launch_hooks_set():
            launch(self.kernel)[(grid,)](*args, **self.constexprs)
            return
        device = torch._C._cuda_getDevice()  # CUDA is initialized: the arguments are CUDA tensors
        slots = self.tensor_slots
        if slots is None:
            slots = self.tensor_slots = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        key = (device, *[args[i].data_ptr() % 16 == 0 for i in slots])
        hit = self.compiled.get(key)
        if hit is None:
            ck = self.kernel[(grid,)](*args, **self.constexprs)
            try:
                tail = tuple(self.constexprs[n] for n in self.tail_names)
                self.compiled[key] = (ck.run, ck.function, ck.packed_metadata, tail)
            except (AttributeError, KeyError):  # pragma: no cover - a Triton without these: no direct path
                self.compiled[key] = False
            return
        if hit is False:  # pragma: no cover
            self.kernel[(grid,)](*args, **self.constexprs)
            return
        run, function, metadata, tail = hit
        run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None, *args, *tail)


def _inline_eligible(types, args, vocab_arg) -> bool:
    if not _settings.compile_inline_kernels:
        return False
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
        if custom_triton_ops_decomposition_disabled():  # torch.export keeps the op whole
            return False
    except ImportError:  # pragma: no cover - older torch
        pass
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if any(not issubclass(t, (FakeTensor, FunctionalTensor)) and t is not torch.Tensor for t in types):
        return False
    logits = args[vocab_arg]
    # a symbolic vocabulary size: the launch plan picks its blocks from V; keep the op whole
    # (other sizes may be symbolic: a dynamic batch or sequence length)
    if logits.dim() == 0 or type(logits.shape[-1]) is not int:
        return False
    if logits.device.type != "cuda":
        # CUDA only: the Triton interpreter cannot run under a tracer (it would run the kernel on fake tensors)
        return False
    # a data-dependent (unbacked) size, e.g. rows packed with nonzero(): the launch plan's layout
    # arithmetic would have to decide it; keep the op whole (its fake needs no such decision)
    return not _has_unbacked_sizes(args)


def _has_unbacked_sizes(args) -> bool:
    try:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(a, torch.Tensor) and free_unbacked_symbols(a.shape) for a in args)


def inline_under_compile(op, implementation, vocab_arg: int, keep_whole=None) -> None:
    """Let a compiler see ``op``'s kernel launches: while AOTAutograd functionalizes a graph
    (torch.compile), a call of ``op`` on CUDA tensors whose vocabulary size (the last dim of
    argument ``vocab_arg``) is static is traced through
    ``implementation`` (its Triton implementation, whose launches go through ``launch``), so
    Inductor's generated code launches the kernels itself instead of calling the op's Python
    implementation on every run. This is what ``torch.library.triton_op`` does, kept on the op
    as registered: its schema, fake implementation, CPU implementation and autograd formula are
    unchanged, and eager calls never come here. settings.compile_inline_kernels turns it off
    (tests/test_logprobs_cuda.py compares its compiled losses and gradients with eager calls).
    ``keep_whole(args, kwargs)``: True for the calls to leave as opaque op calls anyway
    (launches that write one output through two aliasing pointers, which a functional graph
    would give two copies)."""
    if not hasattr(torch.library, "wrap_triton") or not hasattr(op, "register_torch_dispatch"):
        return  # pragma: no cover - torch without wrap_triton: the op stays whole
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    def decomposition(mode, func, types, args, kwargs):
        if not _inline_eligible(types, args, vocab_arg) or (keep_whole is not None and keep_whole(args, kwargs)):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        previous = _INLINE.active
        _INLINE.active = True
        try:
            with mode:
                return implementation(*args, **kwargs)
        finally:
            _INLINE.active = previous

    op.register_torch_dispatch(FunctionalTensorMode, decomposition)
