"""Multi-rank checks on gloo (CPU) for the distributed tests.

A test module makes one ``Checks`` registry and registers its checks with ``@CHECKS.check()``.
Each world size is ONE process group that runs every registered check (a fork server preloads
torch, torch_fused and the test module once, so the ranks start in well under a second); each
check is then reported as its own test by ``CHECKS.assert_check(group, name)``. A check takes a
``Ctx`` and records assertion failures with ``ctx.soft(label)``, so that every rank keeps making
the same collectives whatever fails (a rank leaving early would stall the others). Collectives
are counted with torch_fused.collectives.CollectiveCounter.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torch_fused._library import INTERPRET


class Ctx:
    def __init__(self, rank, world, mesh):
        self.rank, self.world, self.mesh = rank, world, mesh
        self.failures = []

    @contextlib.contextmanager
    def soft(self, label):
        """Record an assertion failure and go on: every rank keeps making the same collectives."""
        try:
            yield
        except AssertionError as e:
            self.failures.append(f"[{label}] {e}")

    def done(self):
        assert not self.failures, "\n".join(self.failures)


class Checks:
    """The multi-rank checks of one test module (``module``: its ``__name__``; it holds this
    registry as ``CHECKS``). ``interpret``: whether a check runs in the interpreter run unless
    its ``check(interpret=...)`` says otherwise; ``preload``: modules the fork server imports
    once; ``timeout_s``: the whole group's limit (a stuck collective fails the tests, never
    hangs them); ``plain_only``: the skip reason of a check the interpreter run leaves out."""

    def __init__(self, module, *, interpret, preload, timeout_s, plain_only):
        self.module, self.interpret, self.preload = module, interpret, list(preload)
        self.timeout_s, self.plain_only = timeout_s, plain_only
        self.checks = {}  # name -> (check, world sizes it runs at)
        self.left_out = set()  # checks defined but not run in this (interpreter) run

    def check(self, interpret=None, worlds=(2, 3)):
        def register(fn):
            if (self.interpret if interpret is None else interpret) or not INTERPRET:
                self.checks[fn.__name__] = (fn, worlds)
            else:
                self.left_out.add(fn.__name__)
            return fn

        return register

    def run_group(self, world, tmp):
        import torch.multiprocessing as tmp_mp

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed.tensor", "torch_fused", *self.preload, __name__,
                                    self.module])
        names = [name for name, (_, worlds) in self.checks.items() if world in worlds]
        pc = tmp_mp.start_processes(_worker, args=(world, str(tmp / "store"), str(tmp), self.module, names),
                                    nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + self.timeout_s
        while not pc.join(timeout=1):
            if time.monotonic() > deadline:
                for p in pc.processes:
                    p.kill()
                pytest.fail(f"world {world}: the process group did not finish in {self.timeout_s} s")
        return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]

    def assert_check(self, group, name):
        if name in self.left_out:
            pytest.skip(self.plain_only)
        assert name in self.checks, f"no check named {name!r} in {self.module} (defined: {sorted(self.checks)})"
        world, results = group
        if world not in self.checks[name][1]:
            pytest.skip(f"runs at world sizes {self.checks[name][1]} (see its docstring)")
        errors = [f"--- rank {r} of {world}:\n{res[name]['error']}" for r, res in enumerate(results)
                  if res[name]["error"]]
        assert not errors, "\n".join(errors)


def _worker(rank, world, store_path, out_dir, module, names):
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch_fused.settings import override
    checks = importlib.import_module(module).CHECKS.checks
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        for name in names:
            t0 = time.perf_counter()
            try:
                with override(poison=True):  # as the suite's conftest: fresh op outputs start as NaN
                    checks[name][0](Ctx(rank, world, mesh))
                err = None
            except Exception:
                err = traceback.format_exc()
            results[name] = {"error": err, "s": round(time.perf_counter() - t0, 2)}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        try:  # no rank tears the group down while a peer still uses it (gloo can abort at exit)
            dist.barrier()
        except Exception:  # a broken group: its checks have already reported the failure
            pass
        dist.destroy_process_group()


def assert_every_check_has_a_test(checks: Checks, module) -> None:
    """Every check the module defines is asserted by one of its tests (a check no test names
    would run in the process group and never be judged)."""
    import inspect

    sources = [inspect.getsource(f) for n, f in vars(module).items() if n.startswith("test_") and callable(f)]
    unjudged = [name for name in sorted(set(checks.checks) | checks.left_out)
                if not any(f'"{name}"' in src for src in sources)]
    assert not unjudged, f"checks of {checks.module} that no test asserts: {unjudged}"
