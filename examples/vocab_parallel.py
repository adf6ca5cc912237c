"""Vocab-parallel log-probs and entropy with torch_fused: a tensor-parallel lm_head on 2 ranks.

    torchrun --nproc-per-node 2 examples/vocab_parallel.py

Runs on CPU (gloo), or on CUDA (nccl) when every rank has a GPU. The lm_head is split over the
vocabulary with ``ColwiseParallel(use_local_output=False)``: its weight becomes a DTensor
``Shard(0)`` and its logits a DTensor ``Shard(-1)``, each rank holding [B, L+1, V / 2]. Then

1. ``torch_fused.logprobs_and_entropy`` takes the sharded logits as they are: one all-gather of
   per-row statistics (O(B * L) elements) forward, no collective backward, the logits' gradient
   a ``Shard(-1)`` DTensor computed locally;
2. ``torch_fused.linear_logprobs_and_entropy`` takes the sharded ``lm_head.weight`` and never
   materializes even a shard of the logits: one all-gather forward, one all-reduce of d hidden
   backward, d weight stays ``Shard(0)``.

Every rank checks its results against the single-device ops on the whole head.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import torch_fused


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = "cuda" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))

    torch.manual_seed(0)  # the same weights, hidden states and tokens on every rank
    b, l, h, v = 2, 16, 64, 1001  # V = 1001 does not divide by the world size: uneven shards are fine
    lm_head = torch.nn.Linear(h, v, bias=False, device=device)
    single = copy.deepcopy(lm_head)  # the single-device head, for the check
    parallelize_module(lm_head, mesh, ColwiseParallel(use_local_output=False))
    hidden = torch.randn(b, l + 1, h, device=device, requires_grad=True)  # the model's last hidden states
    tokens = torch.randint(0, v, (b, l), device=device)

    # 1. log-probs and entropy of sharded logits (shift=True: position t scores tokens[:, t])
    logits = lm_head(hidden)  # DTensor [B, L+1, V], Shard(-1)
    logp, ent = torch_fused.logprobs_and_entropy(logits, tokens, shift=True, temperature=0.9)
    loss = -logp.to_local().mean() - 0.01 * ent.to_local().mean()  # Replicate: the same loss on every rank
    loss.backward()
    assert logits.placements == (Shard(2),) and lm_head.weight.grad.placements == (Shard(0),)

    # 2. the fused head on the sharded weight: no logits at all
    hidden2 = hidden.detach().clone().requires_grad_(True)
    lm_head.weight.grad = None
    logp2, ent2 = torch_fused.linear_logprobs_and_entropy(hidden2, lm_head.weight, tokens, shift=True,
                                                          temperature=0.9)
    (-logp2.to_local().mean() - 0.01 * ent2.to_local().mean()).backward()

    # the single-device ops on the whole head give the same numbers
    hidden_ref = hidden.detach().clone().requires_grad_(True)
    ref_logp, ref_ent = torch_fused.logprobs_and_entropy(single(hidden_ref), tokens, shift=True, temperature=0.9)
    (-ref_logp.mean() - 0.01 * ref_ent.mean()).backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    for got_logp, got_ent, got_dh in ((logp, ent, hidden.grad), (logp2, ent2, hidden2.grad)):
        torch.testing.assert_close(got_logp.to_local(), ref_logp, **tol)
        torch.testing.assert_close(got_ent.to_local(), ref_ent, **tol)
        torch.testing.assert_close(got_dh, hidden_ref.grad, **tol)
    torch.testing.assert_close(lm_head.weight.grad.full_tensor(), single.weight.grad, **tol)
    if rank == 0:
        local_v = lm_head.weight.to_local().shape[0]
        print(f"{world} ranks on {device}: rank 0 holds {local_v} of {v} vocabulary rows; logp {tuple(logp.shape)} "
              f"{logp.placements}, d weight {lm_head.weight.grad.placements}; mean logp {logp.to_local().mean():.4f}, "
              f"mean entropy {ent.to_local().mean():.4f}: equal to the single-device ops")
    # every rank reaches this point before any tears its group down: a rank that exits while a
    # peer still works on the group can abort that peer's gloo threads at exit
    dist.barrier()
    dist.destroy_process_group()
    # Nothing is left to do: leave without the interpreter's teardown. There, torch's gloo worker
    # threads can still be releasing tensors and abort the process ("terminate called without an
    # active exception", SIGABRT; about 1 run in 10 on a loaded 2-core host) after a correct run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
