"""A/B of the SinkGD optimizer step on GPT-2 small's 2-D weights (bf16) between two checkouts of
torch_fused, one process per checkout: step time (do_bench median, as the benchmark), host time
per step (steps enqueued behind a long device-side spin), and fused AdamW on the same weights.

    mkdir -p _ab/old && git archive <commit> torch_fused | tar -x -C _ab/old   # here; untracked
    for r in 1 2; do python benchmarks/sinkgd_ab.py _ab/old; python benchmarks/sinkgd_ab.py .; done
"""

import sys

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402
import triton.testing  # noqa: E402

from torch_fused.bench.common import host_ms  # noqa: E402
from torch_fused.bench.sinkgd import GPT2_SMALL, _params  # noqa: E402
from torch_fused.optim import SinkGD  # noqa: E402


def main():
    tag = sys.argv[1]
    for iters in (5, 1):
        params = _params(GPT2_SMALL)
        opt = SinkGD(params, lr=torch.tensor(1e-3, device="cuda"), sinkhorn_iters=iters)
        for _ in range(3):
            opt.step()
        t = triton.testing.do_bench(opt.step, return_mode="median")
        print(f"{tag} L={iters} step {t:.3f} ms host {host_ms(opt.step):.3f} ms", flush=True)
    params = _params(GPT2_SMALL)
    adam = torch.optim.AdamW(params, lr=1e-4, fused=True)
    adam.step()
    t = triton.testing.do_bench(adam.step, return_mode="median")
    print(f"{tag} AdamW fused {t:.3f} ms host {host_ms(adam.step):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
