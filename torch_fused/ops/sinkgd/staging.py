"""Host values to device tensors for the plans: pinned staging under CUDA-graph capture, a helper
thread otherwise (see _device_tensor)."""

from __future__ import annotations

import threading

import torch


class _HostStaging:
    """Pinned host memory for the work tables of plans built while a CUDA graph is captured.
    The capture records each table's copy as a memcpy node that reads this memory again at
    every replay, so a table's slice is written once and never reused or freed (the arenas live
    as long as the process; a table captured again reuses its slice). Arenas are allocated
    outside captures (``reserve``, called whenever a plan is built outside one), so that a
    capture normally allocates no pinned memory."""

    ARENA_BYTES = 1 << 20

    def __init__(self):
        self.arenas: list[torch.Tensor] = []  # uint8, pinned
        self.used = 0  # bytes used of the last arena
        self.slices: dict = {}

    def reserve(self) -> None:
        if not self.arenas or self.used > self.ARENA_BYTES // 2:
            self.arenas.append(torch.empty(self.ARENA_BYTES, dtype=torch.uint8, pin_memory=True))
            self.used = 0

    def table(self, host: torch.Tensor) -> torch.Tensor:
        key = (host.dtype, tuple(host.tolist()))
        out = self.slices.get(key)
        if out is None:
            nbytes = host.numel() * host.element_size()
            start = -(-self.used // 16) * 16
            if not self.arenas or start + nbytes > self.arenas[-1].numel():
                self.arenas.append(torch.empty(max(self.ARENA_BYTES, nbytes), dtype=torch.uint8, pin_memory=True))
                start = 0
            out = self.arenas[-1][start:start + nbytes].view(host.dtype)
            out.copy_(host)
            self.used = start + nbytes
            self.slices[key] = out
        return out


_STAGING = _HostStaging()


def _device_tensor(values, dtype, dev) -> torch.Tensor:
    """A device tensor of host values (a plan's work table or lr factors).

    - Under CUDA-graph capture (torch.compile's mode="reduce-overhead", or a user's capture):
      copied without a host sync from pinned memory that stays allocated (_HostStaging); the
      device tensor belongs to the call (the capture's pool) and is never cached.
    - otherwise, on CUDA (a plan a cache keeps): allocated and filled by a helper thread.
      torch.compile's CUDA-graph warm-up runs the step with every allocation of the calling
      thread routed into the graphs' memory pool, and a tensor kept from there breaks its
      checks; another thread's allocations go to the ordinary pool. The tensor is then marked
      as used by the calling thread's current stream."""
    host = torch.tensor(values, dtype=dtype)
    if dev.type != "cuda":
        return host.to(dev)
    if torch.cuda.is_current_stream_capturing():
        out = torch.empty(len(values), dtype=dtype, device=dev)
        out.copy_(_STAGING.table(host), non_blocking=True)
        return out
    _STAGING.reserve()
    made: list = []

    def copy():
        try:
            with torch.cuda.device(dev):
                made.append(host.to(dev))  # a synchronous copy: done when it returns
        except BaseException as e:  # raised again in the calling thread
            made.append(e)

    worker = threading.Thread(target=copy)
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    out = made[0]
    out.record_stream(torch.cuda.current_stream(dev))
    return out


