"""Host time of one SinkGD step on GPT-2 small's 2-D weights (bf16): the optimizer's step, the
op through the dispatcher and its implementation called directly, each enqueued behind a long sleep kernel (so nothing waits on the GPU), then a
cProfile of optimizer steps. Run on the device: python benchmarks/sinkgd_host.py"""

import cProfile
import pstats

import torch

import torch_fused  # noqa: F401
from torch_fused.bench.common import host_ms
from torch_fused.bench.sinkgd import GPT2_SMALL, _params
from torch_fused.ops.sinkgd import sinkgd_step_eager
from torch_fused.optim import SinkGD


def main():
    params = _params(GPT2_SMALL)
    opt = SinkGD(params, lr=torch.tensor(1e-3, device="cuda"))
    ws = [p.data for p in params]
    gs = [p.grad for p in params]
    lr = torch.tensor(1e-3, device="cuda")
    seed = torch.zeros((), device="cuda")

    def op():
        torch.ops.fused.sinkgd_step(ws, gs, [], lr, 0.05, 0.0, 1e-8, 5, False, "unit", 1, None, 1.0, False, seed)

    def direct():
        sinkgd_step_eager(ws, gs, [], lr, 0.05, 0.0, 1e-8, 5, False, "unit", 1, None, 1.0, False, seed)

    for _ in range(3):
        opt.step()
        op()
        direct()
    print(f"host per step: optimizer {host_ms(opt.step):.3f} ms, the op through the dispatcher {host_ms(op):.3f} ms, "
          f"its implementation called directly {host_ms(direct):.3f} ms", flush=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        opt.step()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
