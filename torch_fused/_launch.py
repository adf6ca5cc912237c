"""Triton kernel launches with the per-call argument binding done once per specialization.

``kernel[grid](*args, **constexprs)`` binds every argument by name, derives Triton's
specialization of each (dtype and 16-byte alignment of a pointer; an integer's width, whether it
is 1 and whether it divides by 16), formats a cache key from them and looks the compiled kernel
up, on every call: on an H200 host about 30 us of Python per launch, more than the kernel of a
small call. ``launch`` keeps the compiled kernel per key of its own, finer than Triton's (the same
properties, plus the constexprs and launch options by value), and calls its launcher directly on
a hit. A miss compiles (or finds) the kernel through Triton's own path without launching it, then
launches it the same way, so every launch goes through one code path.

The direct call is used only where it is known to be the one Triton itself makes: Triton with
``triton.knobs`` (3.4 and later), no launch hooks installed (profilers such as proton install
them), not in the interpreter. Anywhere else, and for a kernel whose compiled form does not take
the call, ``launch`` is ``kernel[grid](*args, **constexprs)``.
"""

from __future__ import annotations

import inspect

import torch

from ._library import HAS_TRITON, INTERPRET

try:
    from triton import knobs as _knobs
except ImportError:  # older Triton (or none): the plain launch
    _knobs = None

_ENABLED = HAS_TRITON and not INTERPRET and _knobs is not None
_MAX_ENTRIES = 4096  # compiled kernels remembered per process (a dict clear past it)
_cache: dict = {}
_tails: dict = {}  # (kernel, constexpr names) -> parameter names after the positional ones, defaults
_broken: set = set()  # kernels whose direct call failed once: plain launches from then on
_INT32 = 1 << 31


def _arg_key(a):
    t = type(a)
    if t is torch.Tensor:
        return a.dtype, a.data_ptr() & 15 == 0
    if t is int:  # Triton's integer specializations: width, == 1, divisible by 16
        return a == 1, a % 16 == 0, -_INT32 <= a < _INT32
    if t is float:
        return 0.0
    return t, a  # None, bools, anything else: by value


def _tail(kernel, n_pos: int, kwargs: dict):
    """The values Triton binds after the ``n_pos`` positional arguments, in signature order:
    constexprs given by keyword, else their defaults; launch options (num_warps, ...) are not
    parameters and are left out."""
    key = (id(kernel), n_pos, tuple(kwargs))
    spec = _tails.get(key)
    if spec is None:
        params = list(inspect.signature(kernel.fn).parameters.values())[n_pos:]
        spec = tuple((p.name, p.default) for p in params)
        _tails[key] = spec
    return tuple(kwargs[name] if name in kwargs else default for name, default in spec)


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, with Triton's per-call binding skipped on a repeat."""
    if not _ENABLED or id(kernel) in _broken or _knobs.runtime.launch_enter_hook is not None \
            or _knobs.runtime.launch_exit_hook is not None:
        return kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    # id: a JITFunction hashes its source hash; the kernels are module globals, never freed
    key = (id(kernel), device, tuple(map(_arg_key, args)), tuple(kwargs.items()))
    hit = _cache.get(key)
    if hit is None:
        compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)  # compiles, never launches
        if compiled is None:
            return kernel[grid](*args, **kwargs)
        run = compiled.run  # loads the binary: sets .function
        if len(_cache) >= _MAX_ENTRIES:
            _cache.clear()
        hit = (run, compiled.function, compiled.packed_metadata, _tail(kernel, len(args), kwargs))
        _cache[key] = hit
    run, function, metadata, tail = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    try:
        run(grid[0], g1, g2, stream, function, metadata, None, None, None, *args, *tail)
    except TypeError:  # a launcher that takes another call form: Triton's own launch from now on
        _broken.add(id(kernel))
        _cache.pop(key, None)
        return kernel[grid](*args, **kwargs)
    return None
