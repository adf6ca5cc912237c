"""torch_fused.settings: overrides are per thread and per asyncio task, restored exactly, and
read-only outside override; a backward runs under its forward's settings on any thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import torch_fused
from torch_fused import settings


def test_overrides_in_two_threads_neither_cross_nor_leak():
    """Two threads each inside their own override of one setting, interleaved so that the first
    exits while the second is inside: each sees only its own value, and after both the process
    default is back (a shared dict kept one thread's value for good)."""
    default = settings.DEFAULTS["logprobs_bwd_segment"]
    inside_a, inside_b, a_done = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def a():
        try:
            with settings.override(logprobs_bwd_segment=111):
                inside_a.set()
                inside_b.wait(10)
                seen["a_inside"] = settings.current.logprobs_bwd_segment
            seen["a_after"] = settings.current.logprobs_bwd_segment
            a_done.set()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def b():
        try:
            inside_a.wait(10)
            seen["b_before"] = settings.current.logprobs_bwd_segment
            with settings.override(logprobs_bwd_segment=222):
                inside_b.set()
                a_done.wait(10)  # the first thread has left its block: nothing of it is seen here
                seen["b_inside"] = settings.current.logprobs_bwd_segment
                seen["b_values"] = settings.values()["logprobs_bwd_segment"]
            seen["b_after"] = settings.current.logprobs_bwd_segment
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen == dict(a_inside=111, a_after=default, b_before=default, b_inside=222, b_values=222,
                        b_after=default), seen
    assert settings.current.logprobs_bwd_segment == settings.values()["logprobs_bwd_segment"]


def test_overrides_in_asyncio_tasks_are_their_own():
    """Two tasks inside their own override at the same time: each reads its own value."""
    async def task(value, entered, other_entered, read, other_read):
        with settings.override(reference_chunk_elems=value):
            entered.set()
            await other_entered.wait()
            await asyncio.sleep(0)
            got = settings.current.reference_chunk_elems
            read.set()
            await other_read.wait()
            return got

    async def main():
        e1, e2, r1, r2 = (asyncio.Event() for _ in range(4))
        return await asyncio.gather(task(1000, e1, e2, r1, r2), task(2000, e2, e1, r2, r1))

    before = settings.current.reference_chunk_elems
    assert asyncio.run(main()) == [1000, 2000]
    assert settings.current.reference_chunk_elems == before


def test_nested_overrides_restore_exactly_also_on_error():
    before = settings.current.as_dict()
    with pytest.raises(KeyError):
        with settings.override(logprobs_bwd_segment=7, small_tiles=True):
            with settings.override(logprobs_bwd_segment=9):
                assert settings.current.logprobs_bwd_segment == 9 and settings.current.small_tiles is True
            assert settings.current.logprobs_bwd_segment == 7
            raise KeyError("x")
    assert settings.current.as_dict() == before


def test_dict_settings_cannot_be_changed_outside_override():
    """A dict-valued setting reads as a read-only mapping, and the dict given to override is copied:
    mutating either changes nothing."""
    chunk = settings.current.lm_head_chunk_bytes
    with pytest.raises(TypeError):
        chunk["cuda"] = 1
    given = {"cuda": 1 << 20, "cpu": 1 << 16}
    with settings.override(lm_head_chunk_bytes=given):
        given["cpu"] = 5
        assert settings.current.lm_head_chunk_bytes["cpu"] == 1 << 16
        assert dict(settings.current.lm_head_chunk_bytes) == {"cuda": 1 << 20, "cpu": 1 << 16}
    assert settings.current.lm_head_chunk_bytes == chunk
    with pytest.raises(AttributeError, match="override"):
        settings.current.poison = True
    with pytest.raises(ValueError, match="unknown setting"):
        with settings.override(no_such_setting=1):
            pass


def test_a_backward_on_another_thread_runs_under_its_forwards_settings(monkeypatch):
    """The autograd formulas keep the forward's settings for the backward (on CUDA the autograd
    engine runs it on a worker thread, which sees none of the caller's overrides): a backward run
    on a fresh thread sees the forward's override, and the thread's own settings are untouched
    after it. Both the registered op and the eager fast path, through the reference (plain CPU)
    or the kernels' host code (the interpreter run)."""
    from torch_fused import reference
    from torch_fused.ops import logprobs as lp_ops

    seen = []
    for module, name in ((reference, "logprobs_entropy_backward"), (lp_ops, "_settings_key")):
        original = getattr(module, name)

        def spy(*args, _original=original, **kwargs):
            seen.append(settings.current.reference_chunk_elems)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    for call in (lambda x, i: torch.ops.fused.selective_log_softmax(x, i), torch_fused.selective_log_softmax):
        seen.clear()
        x = torch.randn(4, 9, requires_grad=True)
        idx = torch.randint(0, 9, (4,))
        with settings.override(reference_chunk_elems=12345):
            lp = call(x, idx)
        result = {}

        def run():
            result["grad"] = torch.autograd.grad(lp.sum(), x)[0]
            result["after"] = settings.current.reference_chunk_elems

        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        assert "grad" in result
        backward_seen = [v for v in seen if v is not None]
        assert backward_seen and all(v == 12345 for v in backward_seen), seen
        assert result["after"] == settings.DEFAULTS["reference_chunk_elems"]
        torch.testing.assert_close(result["grad"], torch.autograd.grad(
            torch.log_softmax(x, -1).gather(-1, idx[:, None]).sum(), x)[0])


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["public", "op"])
def test_cuda_backward_on_the_engines_thread_sees_the_forwards_settings(path, monkeypatch):
    """On CUDA the autograd engine runs the backward on its own device thread: the backward's
    launch plan is still made under the forward's override (logprobs_bwd_segment here), not the
    process defaults."""
    from torch_fused.ops import logprobs as lp_ops

    seen = []
    original = lp_ops._settings_key

    def spy():
        seen.append((threading.get_ident(), settings.current.logprobs_bwd_segment))
        return original()

    monkeypatch.setattr(lp_ops, "_settings_key", spy)
    x = torch.randn(4, 300, device="cuda", requires_grad=True)
    idx = torch.randint(0, 300, (4,), device="cuda")
    with settings.override(logprobs_bwd_segment=64):
        lp = (torch_fused.selective_log_softmax(x, idx) if path == "public"
              else torch.ops.fused.selective_log_softmax(x, idx))
    seen.clear()
    lp.sum().backward()
    assert seen and all(v == 64 for _, v in seen), seen
    xr = x.detach().double().requires_grad_(True)
    want = torch.autograd.grad(torch.log_softmax(xr, -1).gather(-1, idx[:, None]).sum(), xr)[0]
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-5, atol=1e-6)
