"""Every kernel launch of an interpreter run, compiled for a GPU.

As a pytest plugin (``-p _launch_recorder``, under TRITON_INTERPRET=1): records every kernel
launch (module, kernel, argument types, constexpr values, the pointers passed as None, warps;
an int argument equal to 1 as the constexpr 1, as Triton's launcher specializes it: no kernel
here opts out with do_not_specialize) into the JSON file named by TORCH_FUSED_LAUNCH_RECORD, one
record per distinct launch.
``compile_records`` then compiles each for sm_90 in a process without the interpreter
(tests/test_interpreter.py after the interpreter run; tools/launch_compile.py). The interpreter
runs kernels as Python and accepts code that the compiler rejects for the arguments the launchers
really pass (a None pointer left in a branch that is not resolved at compile time, an
interpreter-only flag set on a GPU launch); this catches it without a GPU."""

from __future__ import annotations

import inspect
import json
import os

_LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                   "launch_pdl", "num_buffers_warp_spec", "num_consumer_groups", "reg_dec_producer",
                   "reg_inc_consumer"}
_SEEN: dict = {}
_DROPPED: set = set()  # "module.kernel: why" of each launch this recorder could not record
# constexprs whose value under the interpreter is not the GPU's: compiled at the GPU's value
GPU_VALUES = {("_matmul_kernel", "UPCAST"): False}  # kernels/lm_head.py: the interpreter's dot has no bf16


def _dtype_code(t):
    import torch

    codes = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
             torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
             torch.bool: "i1"}
    if t.dtype not in codes:
        raise TypeError(f"a tensor of {t.dtype}")
    return codes[t.dtype]


def _is_constexpr(param):
    a = param.annotation
    return a is not inspect.Parameter.empty and ("constexpr" in a if isinstance(a, str) else
                                                  getattr(a, "__name__", "") == "constexpr")


def _record(fn, args, kwargs):
    import torch

    sig = inspect.signature(fn)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAUNCH_OPTIONS}
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    types, cx = {}, {}
    for name, param in sig.parameters.items():
        v = bound.arguments[name]
        v = getattr(v, "value", v)  # a tl.constexpr default
        if _is_constexpr(param):
            cx[name] = v
        elif v is None:
            cx[name] = None
        elif isinstance(v, torch.Tensor):
            types[name] = "*" + _dtype_code(v)
        elif isinstance(v, bool):
            types[name] = "i1"
        elif isinstance(v, int) and v == 1:
            cx[name] = 1  # Triton's launcher specializes an int argument equal to 1 as the constexpr 1
        elif isinstance(v, int):
            types[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            types[name] = "fp32"
        else:
            raise TypeError(f"argument {name}: {type(v).__name__}")
    rec = dict(module=fn.__module__, name=fn.__name__, signature=types, constexprs=cx,
               num_warps=int(options.get("num_warps", 4)))
    key = json.dumps(rec, sort_keys=True, default=str)
    _SEEN.setdefault(key, rec)


def pytest_configure(config):
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        try:
            _record(self.fn, args, dict(kwargs))
        except Exception as e:  # noqa: BLE001 - recording never changes a test's outcome; the drop is reported
            what = f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__name__', '?')}"
            _DROPPED.add(f"{what}: {type(e).__name__}: {e}")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run


def pytest_unconfigure(config):
    path = os.environ.get("TORCH_FUSED_LAUNCH_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump({"launches": list(_SEEN.values()), "dropped": sorted(_DROPPED)}, f, default=str)


def _compile_one(r):
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(r["module"]), r["name"])
    cx = {k: GPU_VALUES.get((r["name"], k), v) for k, v in r["constexprs"].items()}
    sig = dict(r["signature"], **{k: "constexpr" for k in cx})
    try:
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": r["num_warps"]})
        return None
    except Exception as e:  # noqa: BLE001 - every compiler error is a finding
        nones = sorted(k for k, v in cx.items() if v is None)
        return (f"{r['module'].rsplit('.', 1)[-1]}.{r['name']} warps={r['num_warps']} None={nones} "
                f"constexprs={r['constexprs']}: " + " ".join(str(e).split())[:600])


def load_records(path):
    """(the library's records, the library's launches that could not be recorded, with why): a
    kernel a test defines itself is left out."""
    with open(path) as f:
        data = json.load(f)
    return ([r for r in data["launches"] if r["module"].startswith("torch_fused.")],
            [d for d in data["dropped"] if d.startswith("torch_fused.")])


def gpu_variants(records):
    """The records as a GPU launches them: EXACT_SHIFT, always on under the interpreter
    (_library.exact_shift), is off in a GPU's usual launch and on for a tensor temperature or one
    below 0.0014, so a record that has it is compiled both ways."""
    out = []
    for r in records:
        out.append(r)
        if r["constexprs"].get("EXACT_SHIFT") is True:
            out.append(dict(r, constexprs=dict(r["constexprs"], EXACT_SHIFT=False)))
    return out


def compile_records(records, jobs=1, progress=None, timeout=600):
    """Compiles each record for sm_90 (``jobs`` processes, all of them within ``timeout`` seconds
    a record per process); returns the failures' descriptions."""
    if jobs > 1 and len(records) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # (a worker that dies raises BrokenProcessPool here instead of leaving the map waiting)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_one, records, chunksize=8, timeout=timeout * len(records) / jobs))
    else:
        results = []
        for i, r in enumerate(records):
            results.append(_compile_one(r))
            if progress:
                progress(i, r, results[-1])
    return [x for x in results if x is not None]
