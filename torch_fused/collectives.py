"""``CollectiveCounter``: the c10d collectives a block of code dispatches, as a list of (op name,
elements). A check of a sharded setup's communication: the sharded SinkGD step's all-reduces
per Sinkhorn and power iteration, the vocab-parallel ops' one all-gather of row statistics
(the tests and the distributed benchmarks use it).
"""

from __future__ import annotations

import torch

__all__ = ["CollectiveCounter"]


class CollectiveCounter:
    """``with CollectiveCounter() as calls``: calls lists (op name, elements of its tensor
    arguments) of every c10d collective dispatched inside the block (wait_tensor excepted), as a
    TorchDispatchMode sees them on the local tensors. With ``host_copies``, also ("lift_fresh",
    n) for every tensor made from host data (torch.tensor(...)): on a GPU that is a
    host-to-device copy, which waits for the stream and leaves every launch after it exposed."""

    NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional", "_c10d_functional_autograd")

    def __init__(self, host_copies: bool = False):
        self.host_copies = host_copies

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        calls = []
        host_copies = self.host_copies

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace in CollectiveCounter.NAMESPACES and "wait" not in func.__name__:
                    n = sum(t.numel() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
                    calls.append((func.__name__.split(".")[0], n))
                elif host_copies and func is torch.ops.aten.lift_fresh.default:
                    calls.append(("lift_fresh", args[0].numel()))
                return func(*args, **kwargs)

        self.mode = Mode()
        self.mode.__enter__()
        return calls

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
