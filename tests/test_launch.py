"""torch_fused._launch: the cached direct launch gives what Triton's own launch gives, for every
specialization Triton makes (pointer alignment, integers equal to 1 or divisible by 16, integer
width, constexpr values and defaults), on first calls and on repeats."""

import pytest
import torch

from torch_fused import _launch
from torch_fused._library import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def test_arg_key_separates_what_triton_specializes_on():
    key = _launch._arg_key
    base = torch.zeros(64, dtype=torch.float32)
    assert key(base) != key(base[1:])  # 16-byte aligned or not
    assert key(base) != key(base.double())
    assert key(base[4:]) == key(base)  # both aligned (16 bytes): one kernel
    assert len({key(1), key(2), key(16)}) == 3  # == 1, neither, divisible by 16
    assert key(3) == key(17) and key(32) == key(48)
    assert key(2**31 - 16) != key(2**31)  # width: i32 against i64, both divisible by 16
    assert key(1.5) == key(2.0)  # floats are never specialized
    assert key(True) != key(False) and key(None) != key(0)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, a, stride, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs * stride, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        r = a * x + y
        if NEGATE:
            r = -r
        tl.store(out_ptr + offs, r, mask=mask)


def _check(x, y, n, a, stride, **constexprs):
    out = torch.full((n,), float("nan"), device=x.device, dtype=torch.float32)
    _launch.launch(_axpy_kernel, (triton.cdiv(n, 64),), x, y, out, n, a, stride, BLOCK=64, **constexprs)
    want = a * x[: n * stride: stride].float() + y[:n].float()
    if constexprs.get("NEGATE", False):
        want = -want
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
def test_repeats_and_every_specialization_match_the_plain_launch():
    base = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    before = len(_launch._cache)
    for _ in range(3):  # first call, then hits of the cache
        for n in (1, 16, 17, 1000):
            for stride in (1, 2, 16):
                for off in (0, 1, 4):  # aligned, misaligned, aligned again
                    _check(base[off:], y[off:], n, 0.5, stride)
                    _check(base[off:], y, n, -2.0, stride, NEGATE=True)
    # one entry per specialization (not per call): the repeats added nothing
    added = len(_launch._cache) - before
    assert 0 < added <= 4 * 3 * 3 * 2
    _check(base.half(), y, 100, 1.0, 1)  # another dtype: its own kernel
    assert len(_launch._cache) == before + added + 1
