"""SinkGD on sharded parameters (torch_fused/optim/sharded.py): DTensor Shard(0) matrices and
torch.distributed.fsdp.fully_shard models.

Gloo on CPU, world sizes 2 and 3 (uneven row splits: m = 7 over 2 and 3 ranks, m = 2 over 3
leaves a rank no rows), spawned with torch.multiprocessing. The plain CPU run takes the sharded
step's PyTorch-op path; the interpreter run (CPU as a Triton device) its fused-kernel path, for
the value, stochastic-rounding and fully_shard training checks. Each world size is ONE process
group that runs every check (a fork server preloads torch and torch_fused once); each check is
reported as its own test. Every rank compares with the single-device step on the whole
matrices (computed in the same process):

- values: plain and spectral ("unit", "muon") steps, fp32 (to ~1e-5) and bf16 (to rounding),
  a Shard(0) batch [B, m, n], a Shard(1) row split of [B, m, n], a Replicate() matrix, a zero
  row and column; bf16 with stochastic rounding against the interpreted update kernel;
- what the collectives carry, counted by a TorchDispatchMode over the c10d functional ops:
  one all-reduce per Sinkhorn iteration and per power iteration, of exactly the column
  partials (and the spectral scalars);
- a fully_shard MLP (3 Linear layers with biases) trained against an unsharded replica,
  the optimizer's state_dict round trip; sinkgd_param_groups on a fully_shard model (2-D
  DTensors through AdamW); torch.compile of the step;
- clear errors for placements the sharded step does not take.

Single-process tests (no group): the update kernel's random bits reproduced by the sharded
path's PyTorch Philox, and its update of row slices, checked against the Triton kernels where
they run (the interpreter run on CPU, and CUDA); load_state_dict keeps the warm-start vectors
float32.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.distributed as dist

import torch_fused  # noqa: F401
from torch_fused._library import HAS_TRITON, INTERPRET, TRITON_DEVICES
from torch_fused.collectives import CollectiveCounter
from _distributed import Checks
from _helpers import DEVICES

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

# The interpreter run (CPU as a Triton device) takes the sharded step through the fused kernels
# (optim/sharded.py::_fused_step), the plain CPU run through its PyTorch ops: both run the value
# check at world sizes 2 and 3 (a rank with no rows of a matrix); the rest of the distributed
# logic is the same code in both and runs in the plain run only.
WORLDS = [2, 3]
GROUP_TIMEOUT_S = 240
CHECKS = Checks(__name__, interpret=False, preload=["torch.distributed.fsdp", "torch_fused.optim.sharded",
                                                   "torch._dynamo"],
                 timeout_s=GROUP_TIMEOUT_S, plain_only="distributed logic only: the plain CPU run covers it")
check = CHECKS.check


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _bf16_close(got, want, label):
    """bf16 results of the same step: equal but where the fp32 values straddle a rounding
    boundary (then one bf16 ulp apart), which must be rare."""
    g, w = got.float(), want.float()
    diff = (g - w).abs()
    ulp = w.abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool((diff <= ulp * 1.01).all()), f"{label}: bf16 difference beyond one ulp: {diff.max().item()}"
    frac = (diff > 0).float().mean().item()
    assert frac <= 0.02, f"{label}: {frac:.3%} of the bf16 entries differ"


# ---------------------------------------------------------------------------------------------
# Checks: run inside every rank of the group
# ---------------------------------------------------------------------------------------------
# (name, global shape, Shard dim, dtype)
MATS = [
    ("w7x5", (7, 5), 0, torch.float32),  # uneven rows over 2 and 3 ranks
    ("w2x6", (2, 6), 0, torch.float32),  # world 3: a rank with no rows
    ("w16x9", (16, 9), 0, torch.bfloat16),
    ("b3x4x6", (3, 4, 6), 0, torch.float32),  # a batch of whole matrices: no collective
    ("b2x7x3", (2, 7, 3), 1, torch.float32),  # a batch whose rows are split
    ("w9x8", (9, 8), 0, torch.float32),
    ("r5x4", (5, 4), None, torch.float32),  # Replicate(): stepped locally, no collective
]
STEP_CASES = [
    dict(sinkhorn_iters=5),
    dict(sinkhorn_iters=2, weight_decay=0.1, base_width=4.0, width_exponent=0.5),
    dict(sinkhorn_iters=3, spectral_norm=True, spectral_target="unit", spectral_iters=2),
    dict(sinkhorn_iters=1, spectral_norm=True, spectral_target="muon", spectral_iters=1, weight_decay=0.05),
    dict(sinkhorn_iters=0),
]
# The interpreter run at world size 3 (what it adds to world size 2: a rank with no rows, rows
# split 3 ways) takes one plain and one spectral case; world size 2 there, and both world sizes
# in the plain run, take every case.
INTERPRET_WORLD3_CASES = (0, 3)


def _full_mats(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape, d, dtype in MATS:
        w = torch.randn(shape, generator=g).to(dtype)
        gr = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 3
        if name == "w9x8":
            gr[5] = 0.0  # a zero row (its scale hits the 1e30 clamp) on the last rank
            gr[:, 2] = 0.0  # and a zero column
        out.append((name, w, gr.to(dtype), d))
    return out


def _dist(t, mesh, d):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return distribute_tensor(t, mesh, [Replicate() if d is None else Shard(d)])


@check(interpret=True)
def step_values_and_collectives(ctx):
    """Every STEP_CASES step on all MATS at once (one call) equals the single-device step on the
    whole matrices, the warm-start vectors too; the collectives are one all-reduce per
    Sinkhorn iteration and per power iteration, of exactly the row-split matrices' column
    partials (and [B] scalars per power iteration)."""
    from torch_fused.optim import sinkgd_step
    from torch_fused.optim.sharded import sinkgd_step_sharded

    for ci, case in enumerate(STEP_CASES):
        if INTERPRET and ctx.world == 3 and ci not in INTERPRET_WORLD3_CASES:
            continue
        mats = _full_mats(10 + ci)
        ps = [_dist(w.clone(), ctx.mesh, d) for _, w, _, d in mats]
        gs = [_dist(g, ctx.mesh, d) for _, _, g, d in mats]
        ref_ps = [w.clone() for _, w, _, _ in mats]
        vecs = ref_vecs = None
        if case.get("spectral_norm"):
            from torch_fused.optim.sinkgd import _warm_start

            vecs = [_warm_start(p) for p in ps]
            ref_vecs = [_warm_start(p) for p in ref_ps]
        step = torch.tensor(3.0)
        with CollectiveCounter() as calls:
            sinkgd_step_sharded(ps, gs, lr=0.7, spectral_vecs=vecs, step=step, **case)
        sinkgd_step(ref_ps, [g for _, _, g, _ in mats], lr=0.7, spectral_vecs=ref_vecs, step=step, **case)
        for k, (name, w0, _, d) in enumerate(mats):
            label = f"case {ci} {name}"
            with ctx.soft(label):
                got = ps[k].full_tensor()
                if w0.dtype == torch.float32:
                    e = _rel(got - w0, ref_ps[k] - w0)
                    assert e < 2e-5, f"{label}: update differs, norm-wise relative error {e:.2e}"
                else:
                    _bf16_close(got, ref_ps[k], label)
                if vecs is not None:
                    v = vecs[k].full_tensor() if hasattr(vecs[k], "full_tensor") else vecs[k]
                    e = _rel(v.reshape(ref_vecs[k].shape), ref_vecs[k])
                    assert e < 2e-5, f"{label}: warm-start vector differs, relative error {e:.2e}"
        with ctx.soft(f"case {ci} collectives"):
            rows = [(shape, d) for _, shape, d, _ in MATS if d is not None and d == len(shape) - 2]
            cols = sum(math.prod(shape[:-2]) * shape[-1] for shape, _ in rows)
            scal = sum(math.prod(shape[:-2]) for shape, _ in rows)
            L = case["sinkhorn_iters"]
            s_it = case.get("spectral_iters", 1) if case.get("spectral_norm") else 0
            want = [("all_reduce", cols)] * L + [("all_reduce", cols + scal)] * s_it
            assert calls == want, f"collectives {calls}, expected {want}"
            total = sum(n for _, n in calls)
            assert total <= (L + 2) * cols + s_it * scal
    ctx.done()


@check(interpret=True)
def float64_step_is_float64(ctx):
    """float64 parameters, sharded, beside float32 ones in the same call: lr=0 leaves the float64
    ones bitwise unchanged (W was rounded through float32 before), a step matches the unsharded
    float64 step to float64 accuracy (lr 0.1, not a float32: taken in float64), spectral too,
    and the float32 matrix of the same call still matches its own unsharded step."""
    from torch_fused.optim import sinkgd_step
    from torch_fused.optim.sharded import sinkgd_step_sharded
    from torch_fused.optim.sinkgd import _warm_start

    g = torch.Generator().manual_seed(12)
    shapes = [((7, 6), torch.float64), ((9, 5), torch.float32), ((2, 5, 4), torch.float64)]
    ws = [(torch.randn(s, generator=g) * 3).to(dt) for s, dt in shapes]
    gs = [torch.randn(s, generator=g).to(dt) for s, dt in shapes]
    for lr, spectral in ((0.0, False), (0.1, False), (0.1, True)):
        label = f"lr {lr} spectral {spectral}"
        ps = [_dist(w.clone(), ctx.mesh, 0 if w.dim() == 2 else 1) for w in ws]
        dgs = [_dist(x, ctx.mesh, 0 if x.dim() == 2 else 1) for x in gs]
        ref = [w.clone() for w in ws]
        vecs = [_warm_start(p) for p in ps] if spectral else None
        ref_vecs = [_warm_start(w) for w in ref] if spectral else None
        sinkgd_step_sharded(ps, dgs, lr=lr, weight_decay=0.1, spectral_norm=spectral, spectral_vecs=vecs)
        sinkgd_step(ref, gs, lr=lr, weight_decay=0.1, spectral_norm=spectral, spectral_vecs=ref_vecs)
        for k, (w0, want) in enumerate(zip(ws, ref)):
            with ctx.soft(f"{label} matrix {k}"):
                got = ps[k].full_tensor()
                if lr == 0.0 and w0.dtype == torch.float64:
                    assert torch.equal(got, w0), f"{label}: moved by {(got - w0).abs().max().item():.2e} at lr 0"
                elif w0.dtype == torch.float64:
                    err = (got - want).abs().max().item()
                    assert err < 1e-13, f"{label} matrix {k}: {err:.2e} from the unsharded float64 step"
                else:
                    e = _rel(got - w0, want - w0)
                    assert e < 2e-5, f"{label} matrix {k}: update differs, norm-wise relative error {e:.2e}"
    ctx.done()


@check(interpret=True)
def zero_gradient_keeps_the_spectral_estimate(ctx):
    """A spectral step on all-zero gradients, then a real one, sharded: the zero step leaves W
    as it was and restarts v (it was 0 for good, and later steps multiplied X by target / eps);
    both steps match the unsharded ones, v included."""
    from torch_fused.optim import sinkgd_step
    from torch_fused.optim.sharded import sinkgd_step_sharded
    from torch_fused.optim.sinkgd import _warm_start

    g = torch.Generator().manual_seed(13)
    shapes = [(7, 6), (2, 5, 4)]
    ws = [torch.randn(s, generator=g) for s in shapes]
    gs = [torch.randn(s, generator=g) for s in shapes]
    ps = [_dist(w.clone(), ctx.mesh, 0 if w.dim() == 2 else 1) for w in ws]
    ref = [w.clone() for w in ws]
    vecs = [_warm_start(p) for p in ps]
    ref_vecs = [_warm_start(w) for w in ref]
    kw = dict(lr=0.5, sinkhorn_iters=1, spectral_norm=True, spectral_target="muon")
    for label, grads in (("zero step", [torch.zeros_like(x) for x in gs]), ("real step", gs)):
        sinkgd_step_sharded(ps, [_dist(x, ctx.mesh, 0 if x.dim() == 2 else 1) for x in grads], spectral_vecs=vecs, **kw)
        sinkgd_step(ref, grads, spectral_vecs=ref_vecs, **kw)
        for k, w0 in enumerate(ws):
            with ctx.soft(f"{label} matrix {k}"):
                got = ps[k].full_tensor()
                v = vecs[k].full_tensor() if hasattr(vecs[k], "full_tensor") else vecs[k]
                assert bool((v.norm(dim=-1) > 0).all()), f"{label}: a zero warm-start vector"
                if label == "zero step":
                    assert torch.equal(got, w0), f"{label}: W moved"
                else:
                    e = _rel(got - w0, ref[k] - w0)
                    assert e < 2e-5, f"{label} matrix {k}: update differs, norm-wise relative error {e:.2e}"
                    assert _rel(v.reshape(ref_vecs[k].shape), ref_vecs[k]) < 2e-5, f"{label}: v differs"
    ctx.done()


@check(interpret=True, worlds=(2,))
def stochastic_rounding_bits(ctx):
    """bf16 with stochastic_round on a Triton device (the interpreter run on CPU): the sharded
    step's random bits are the update kernel's at each element's index in the whole matrix
    and its matrix index in the group. With sinkhorn_iters=0 the fp32 values are the same
    operations in the same order, so the results are bitwise equal; with iterations, equal
    but where the scales' last-bit differences cross a rounding step."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_fused.optim import sinkgd_step
    from torch_fused.optim.sharded import sinkgd_step_sharded, update_salts

    if "cpu" not in TRITON_DEVICES:
        return  # the plain CPU run rounds to nearest on both paths: step_values_and_collectives
    g = torch.Generator().manual_seed(5)
    shapes = [(7, 16), (6, 5), (9, 16), (2, 3, 8)]  # n = 5: another alignment class (its own salt count)
    for iters, step in ((0, 2.0), (2, 3001.0)):  # 3001 * 1000003 wraps int32: a negative seed
        ws = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
        gs = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
        ps = [distribute_tensor(w.clone(), ctx.mesh, [Shard(0)]) for w in ws]
        dgs = [distribute_tensor(x, ctx.mesh, [Shard(0)]) for x in gs]
        ref = [w.clone() for w in ws]
        kw = dict(lr=3.0, weight_decay=0.1, sinkhorn_iters=iters, stochastic_round=True,
                  step=torch.tensor(step))
        sinkgd_step_sharded(ps, dgs, salts=update_salts(ps, dgs), **kw)
        sinkgd_step(ref, gs, **kw)
        for k, (w0, want) in enumerate(zip(ws, ref)):
            label = f"iters {iters} matrix {k}"
            with ctx.soft(label):
                got = ps[k].full_tensor()
                if iters == 0:
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                        f"{label}: {(got != want).sum().item()} of {got.numel()} entries differ"
                else:
                    _bf16_close(got, want, label)
    ctx.done()


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 11), torch.nn.Tanh(), torch.nn.Linear(11, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 5))


@check(interpret=True)
def fully_shard_mlp_training(ctx):
    """fully_shard on every Linear and the root: SinkGD (spectral "muon" with weight decay on
    the weights, AdamW on the biases as DTensors) trained 4 steps on the same batches as an
    unsharded replica: the same parameters. Then the optimizer's state_dict (warm-start
    vectors, AdamW moments, step counts) loads into a new optimizer whose next step again
    matches the replica's, and the step's collectives are the Sinkhorn and power iterations'
    all-reduces alone."""
    from torch.distributed.fsdp import fully_shard
    from torch_fused.optim import SinkGD

    model = _mlp(0)
    replica = copy.deepcopy(model)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    kw = dict(lr=0.5, sinkhorn_iters=3, spectral_norm=True, spectral_target="muon", weight_decay=0.1,
              fallback_kwargs=dict(lr=1e-2, weight_decay=0.01))
    opt = SinkGD(model.parameters(), **kw)
    ref_opt = SinkGD(replica.parameters(), **kw)
    g = torch.Generator().manual_seed(1)

    def train(m, o, x, y):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()

    def compare(label, tol):
        for (name, p), q in zip(model.named_parameters(), replica.parameters()):
            with ctx.soft(f"{label} {name}"):
                e = _rel(p.full_tensor(), q)
                assert e < tol, f"{label} {name}: relative error {e:.2e}"

    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)) for _ in range(5)]
    for i, (x, y) in enumerate(batches[:4]):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with CollectiveCounter() as calls:  # the last step's are checked
            opt.step()
        train(replica, ref_opt, x, y)
    compare("after 4 steps", 1e-5)
    with ctx.soft("optimizer step collectives"):
        cols = 6 + 11 + 7  # the three weights' columns, all row-sharded
        assert calls == [("all_reduce", cols)] * 3 + [("all_reduce", cols + 3)], calls
    # the state_dict round trip: a new optimizer over the same model continues identically
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    opt2 = SinkGD(model.parameters(), **kw)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    with ctx.soft("state_dict types"):
        for p in model.parameters():
            st = opt2.state[p]
            if p.dim() >= 2:
                v = st["spectral_v"]
                assert type(v) is torch.Tensor and v.dtype == torch.float32, (type(v), v.dtype)
                assert torch.equal(v, opt.state[p]["spectral_v"])
            else:
                assert type(st["exp_avg"]).__name__ == "DTensor"
    train(model, opt2, *batches[4])
    train(replica, ref_opt, *batches[4])
    compare("after the reloaded step", 1e-5)
    ctx.done()


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.body = torch.nn.Linear(6, 9)
        self.lm_head = torch.nn.Linear(9, 10, bias=False)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.body(self.emb(ids))))


@check()
def fully_shard_param_groups(ctx):
    """sinkgd_param_groups on a fully_shard model: the embedding and the head (2-D DTensors)
    and the bias go to AdamW, the body's weight to SinkGD; 3 steps equal the unsharded
    replica's, and only the body's weight makes collectives."""
    from torch.distributed.fsdp import fully_shard
    from torch_fused.optim import SinkGD, sinkgd_param_groups

    torch.manual_seed(0)
    model = _TinyLM()
    replica = copy.deepcopy(model)
    fully_shard(model.body, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    opt = SinkGD(sinkgd_param_groups(model, lr=1e-2), lr=0.5, sinkhorn_iters=2)
    ref_opt = SinkGD(sinkgd_param_groups(replica, lr=1e-2), lr=0.5, sinkhorn_iters=2)
    with ctx.soft("groups"):
        assert [len(gr["params"]) for gr in opt.param_groups] == [1, 3], [len(gr["params"]) for gr in opt.param_groups]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 10, (4, 5), generator=g)
        tgt = torch.randint(0, 10, (4, 5), generator=g)
        for m, o in ((model, opt), (replica, ref_opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), tgt.flatten()).backward()
            with CollectiveCounter() as calls:
                o.step()
            if m is model:
                with ctx.soft("collectives"):
                    assert calls == [("all_reduce", 6)] * 2, calls
    for (name, p), q in zip(model.named_parameters(), replica.parameters()):
        with ctx.soft(name):
            e = _rel(p.full_tensor(), q)
            assert e < 1e-5, f"{name}: relative error {e:.2e}"
    ctx.done()


@check()
def compiled_step(ctx):
    """torch.compile(opt.step) on sharded parameters (matrices and a 1-D AdamW parameter, uneven
    splits) gives the eager step's values: the DTensor parameters' steps run eagerly inside the
    compiled step (graph breaks; docs/SINKGD.md)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_fused.optim import SinkGD

    mats = _full_mats(3)
    results = []
    for compiled in (False, True):
        ps = [torch.nn.Parameter(_dist(w.clone(), ctx.mesh, d)) for _, w, _, d in mats]
        for p, (_, _, gr, d) in zip(ps, mats):
            p.grad = _dist(gr, ctx.mesh, d)
        bias = torch.nn.Parameter(distribute_tensor(torch.linspace(-1, 1, 7), ctx.mesh, [Shard(0)]))
        bias.grad = distribute_tensor(torch.linspace(2, -1, 7), ctx.mesh, [Shard(0)])
        ps.append(bias)  # AdamW on a DTensor
        opt = SinkGD(ps, lr=torch.tensor(0.5), sinkhorn_iters=2, spectral_norm=True)
        fn = torch.compile(opt.step) if compiled else opt.step
        for _ in range(2):
            fn()
        results.append([p.full_tensor() for p in ps])
    for k, (a, b) in enumerate(zip(*results)):
        with ctx.soft(f"matrix {k}"):
            # the state (warm-start vectors included) is made eagerly (SinkGD._init_group) and
            # DTensor steps run outside the graph: the same bits
            assert torch.equal(a, b), f"matrix {k}: compiled step differs, relative error {_rel(a, b):.2e}"
    ctx.done()


@check()
def unsupported_placements_fail_clearly(ctx):
    """Shard(1) of a matrix (its columns), a 2-D mesh, Partial, a plain gradient for a DTensor
    parameter, a DTensor warm-start vector for a row-split matrix: ValueError naming the
    argument and the placement."""
    import re

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch_fused.optim import SinkGD
    from torch_fused.optim.sharded import sinkgd_step_sharded

    w = torch.randn(6, 4)
    mesh2 = init_device_mesh("cpu", (1, ctx.world))

    def sh(t, pl, mesh=ctx.mesh):
        return distribute_tensor(t.clone(), mesh, pl)

    cases = [
        ([sh(w, [Shard(1)])], [sh(w, [Shard(1)])], {}, r"params\[0\]: .*Shard\(dim=1\).*columns"),
        ([sh(w, [Replicate(), Shard(0)], mesh2)], [sh(w, [Replicate(), Shard(0)], mesh2)], {},
         r"params\[0\]: .*2-D mesh"),
        ([DTensor.from_local(w, ctx.mesh, [Partial()])], [DTensor.from_local(w, ctx.mesh, [Partial()])], {},
         r"params\[0\]: .*Partial"),
        ([sh(w, [Shard(0)])], [w.clone()], {}, r"grads\[0\]: .*got a Tensor"),
        ([sh(w, [Shard(0)])], [sh(w, [Replicate()])], {}, r"grads\[0\]: .*Replicate"),
        ([sh(w, [Shard(0)])], [sh(w, [Shard(0)])],
         dict(spectral_norm=True, spectral_vecs=[sh(torch.ones(1, 4), [Replicate()])]),
         r"spectral_vecs\[0\]: expected a float32 plain tensor of shape \(1, 4\)"),
        ([sh(w, [Shard(0)])], [sh(w, [Shard(0)])], dict(sinkhorn_iters=-1), r"sinkhorn_iters: expected >= 0"),
    ]
    for k, (ps, gs, kw, pattern) in enumerate(cases):
        with ctx.soft(f"case {k}"):
            try:
                sinkgd_step_sharded(ps, gs, lr=0.1, **kw)
            except ValueError as e:
                assert re.search(pattern, str(e)), f"case {k}: message {e!r} does not match {pattern!r}"
            else:
                raise AssertionError(f"case {k}: no error")
    with ctx.soft("through the optimizer"):
        p = torch.nn.Parameter(sh(w, [Shard(1)]))
        p.grad = sh(w, [Shard(1)])
        try:
            SinkGD([p], lr=0.1).step()
        except ValueError as e:
            assert "Shard(dim=1)" in str(e), str(e)
        else:
            raise AssertionError("no error")
    ctx.done()


# ---------------------------------------------------------------------------------------------
# The group
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def group(request, tmp_path_factory):
    world = request.param
    return world, CHECKS.run_group(world, tmp_path_factory.mktemp(f"sinkgd_sharded_w{world}"))


_assert_check = CHECKS.assert_check


def test_step_values_and_collectives(group):
    _assert_check(group, "step_values_and_collectives")


def test_zero_gradient_keeps_the_spectral_estimate(group):
    _assert_check(group, "zero_gradient_keeps_the_spectral_estimate")


def test_stochastic_rounding_bits(group):
    _assert_check(group, "stochastic_rounding_bits")


def test_fully_shard_mlp_training(group):
    _assert_check(group, "fully_shard_mlp_training")


def test_fully_shard_param_groups(group):
    _assert_check(group, "fully_shard_param_groups")


def test_float64_step_is_float64(group):
    _assert_check(group, "float64_step_is_float64")


def test_compiled_step(group):
    _assert_check(group, "compiled_step")


def test_unsupported_placements_fail_clearly(group):
    _assert_check(group, "unsupported_placements_fail_clearly")


# ---------------------------------------------------------------------------------------------
# Single process: the random bits, the optimizer's state
# ---------------------------------------------------------------------------------------------
NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@NEEDS_TRITON
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["plain", "stochastic_round", "spectral_muon"])
def test_world_of_one_kernel_path_is_the_fused_step(device, config):
    """The sharded step's kernel path at a world of 1 (the fake process group: an all-reduce
    returns its input) is bitwise the fused single-device step: the column sums that
    _sinkgd_colsum_kernel finishes and the scale kernels read back (SUMMED) are the sums those
    kernels form themselves; the update's random bits are keyed alike. Two dtype groups, a
    batch of matrices, rows of both load classes, a matrix too wide for the one-read pass in
    the interpreter run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_fused.optim import sinkgd_step
    from torch_fused.optim.sharded import sinkgd_step_sharded
    from torch_fused.optim.sinkgd import _warm_start

    if device not in TRITON_DEVICES:
        pytest.skip("the kernel path runs on Triton devices (CUDA, or the CPU in the interpreter run)")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    cfg = {"plain": dict(sinkhorn_iters=3, weight_decay=0.1, base_width=8.0),
           "stochastic_round": dict(sinkhorn_iters=2, stochastic_round=True),
           "spectral_muon": dict(sinkhorn_iters=2, spectral_norm=True, spectral_target="muon",
                                 spectral_iters=2)}[config]
    gen = torch.Generator().manual_seed(31)
    specs = [((9, 16), torch.bfloat16), ((7, 5), torch.bfloat16), ((3, 4, 8), torch.bfloat16),
             ((6, 70), torch.float32), ((5, 12), torch.float32)]
    ws = [torch.randn(s, generator=gen).to(dt).to(device) for s, dt in specs]
    gs = [torch.randn(s, generator=gen).to(dt).to(device) for s, dt in specs]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        # from_local, not distribute_tensor: the latter scatters from rank 0, which the fake
        # group never does (on CUDA the shards were left uninitialized)
        ps = [DTensor.from_local(w.clone(), mesh, [Shard(0)], run_check=False) for w in ws]
        dgs = [DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False) for g in gs]
        assert all(torch.equal(p.to_local(), w) for p, w in zip(ps, ws))
        ref = [w.clone() for w in ws]
        vecs = [_warm_start(w) for w in ws] if cfg.get("spectral_norm") else None
        ref_vecs = [v.clone() for v in vecs] if vecs else None
        if vecs:  # a Shard(0) batch keeps its vectors sharded like it
            from torch_fused.optim.sharded import shard_like, warm_start_is_sharded

            vecs = [shard_like(v.reshape(p.shape[:-2] + p.shape[-1:]), p) if warm_start_is_sharded(p) else v
                    for v, p in zip(vecs, ps)]
        step = torch.tensor(5.0, device=device)
        sinkgd_step_sharded(ps, dgs, lr=0.4, spectral_vecs=vecs, step=step, **cfg)
        sinkgd_step(ref, gs, lr=0.4, spectral_vecs=ref_vecs, step=step, **cfg)
        for k, (p, want) in enumerate(zip(ps, ref)):
            got = p.to_local()
            assert torch.equal(got, want), f"matrix {k}: {(got != want).sum().item()} of {got.numel()} differ"
            assert not torch.equal(got, ws[k])
        for k, (v, want) in enumerate(zip(vecs or [], ref_vecs or [])):
            got = v.to_local().reshape(want.shape) if hasattr(v, "to_local") else v
            assert torch.equal(got, want), f"warm-start vector {k} differs"
    finally:
        dist.destroy_process_group()


@NEEDS_TRITON
@pytest.mark.parametrize("device", list(TRITON_DEVICES) or ["cuda"])
def test_philox_matches_triton_randint(device):
    """philox_words(sr_seed(step, salt), offsets) is tl.randint4x(int32(step) * 1000003 + salt,
    offsets) as the update kernel calls it (all four words), including seeds that wrap to
    negative int32; sr_noise picks word (e >> 1) & 3 of counter e >> 3, low half for even e."""
    import triton
    import triton.language as tl

    from torch_fused.optim.sharded import philox_words, sr_noise, sr_seed

    @triton.jit
    def randint_kernel(p_seed, out, n, salt, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        seed = tl.load(p_seed).to(tl.int32) * 1000003 + salt
        w0, w1, w2, w3 = tl.randint4x(seed, o.to(tl.uint32))
        tl.store(out + o, w0, mask=o < n)
        tl.store(out + n + o, w1, mask=o < n)
        tl.store(out + 2 * n + o, w2, mask=o < n)
        tl.store(out + 3 * n + o, w3, mask=o < n)

    n = 200
    for step, salt in ((0.0, 0), (1.0, 3), (3001.0, 1), (1e6, 7)):
        st = torch.tensor(step, device=device)
        out = torch.empty(4 * n, dtype=torch.int32, device=device)
        randint_kernel[(triton.cdiv(n, 64),)](st, out, n, salt, B=64)
        want = (out.to(torch.int64) & 0xFFFFFFFF).reshape(4, n)
        got = torch.stack(philox_words(sr_seed(st, salt), torch.arange(n, dtype=torch.int64, device=device)))
        assert torch.equal(got, want), f"step {step} salt {salt}: {(got != want).sum().item()} of {4 * n} differ"
        e = torch.arange(8 * n, dtype=torch.int64, device=device)
        noise = sr_noise(sr_seed(st, salt), e)
        word = want[(e >> 1) & 3, e >> 3]
        assert torch.equal(noise, torch.where(e % 2 == 0, word & 0xFFFF, word >> 16))


@NEEDS_TRITON
@pytest.mark.parametrize("device", list(TRITON_DEVICES) or ["cuda"])
def test_update_rows_match_kernel(device):
    """The sharded update on row slices of the whole matrices (what each rank runs) against the
    update kernel on the whole matrices, bf16 with stochastic rounding and no Sinkhorn
    iteration (r = c = 1: the same fp32 operations): the same bits. Several matrices of two
    alignment classes, so the matrix salts are the op's."""
    from torch_fused.optim import sinkgd_step
    from torch_fused.optim.sharded import ShardInfo, _Mat, _update, sr_seed, update_salts

    g = torch.Generator().manual_seed(2)
    shapes = [(9, 16), (6, 5), (11, 24), (5, 8)]
    ws = [torch.randn(s, generator=g).to(torch.bfloat16).to(device) for s in shapes]
    gs = [torch.randn(s, generator=g).to(torch.bfloat16).to(device) for s in shapes]
    ref = [w.clone() for w in ws]
    lr, wd, step = 3.0, 0.1, torch.tensor(7.0, device=device)
    sinkgd_step(ref, gs, lr=lr, weight_decay=wd, sinkhorn_iters=0, stochastic_round=True, step=step)
    salts = update_salts(ws, gs)
    total = mismatched = 0
    for k, (w, gr) in enumerate(zip(ws, gs)):
        m, n = shapes[k]
        for a, e in ((0, 4), (4, m)):  # two "ranks", the second uneven
            w_loc = w[a:e].clone()
            info = ShardInfo("rows", None, 1, m, n, 1, e - a, 0, a)
            mat = _Mat(w_loc.view(1, e - a, n), gr[a:e].view(1, e - a, n), info, None)
            eta = torch.tensor(lr, dtype=torch.float32, device=device) * 0.05
            _update(mat, eta.expand(1), eta * wd, sr_seed(step, salts[k]))
            diff = (w_loc.view(torch.int16) != ref[k][a:e].view(torch.int16))
            total += diff.numel()
            mismatched += int(diff.sum())
    # the interpreter evaluates the kernel's fp32 operations exactly as PyTorch does; a GPU may
    # contract them into an fma (a last-bit difference that moves 1 in 2^16 results)
    allowed = 0 if device == "cpu" else max(2, total // 2000)
    assert mismatched <= allowed, f"{mismatched} of {total} entries differ"


def test_state_dict_keeps_warm_start_float32():
    """load_state_dict casts floating state to the parameter's dtype; the warm-start vectors of
    bf16 matrices stay float32."""
    from torch_fused.optim import SinkGD

    p = torch.nn.Parameter(torch.randn(5, 4).to(torch.bfloat16))
    p.grad = torch.randn(5, 4).to(torch.bfloat16)
    opt = SinkGD([p], lr=0.1, spectral_norm=True)
    opt.step()
    opt2 = SinkGD([p], lr=0.1, spectral_norm=True)
    opt2.load_state_dict(opt.state_dict())
    v = opt2.state[p]["spectral_v"]
    assert v.dtype == torch.float32 and torch.equal(v, opt.state[p]["spectral_v"])
    opt2.step()


def test_every_check_has_a_test():
    import sys

    from _distributed import assert_every_check_has_a_test

    assert_every_check_has_a_test(CHECKS, sys.modules[__name__])


def test_row_step_of_huge_gradients_is_finite():
    """The PyTorch path's row step squares the rows scaled: a gradient scaled by 2^100 (its
    squares past fp32) gives r scaled by 2^-100 and the same column partials. Near the fp32
    maximum (entries up to 2.6e38) neither the norm a * s nor G c (c > 1) may be formed: the
    first iteration (r = c = 1) and a later one (r near 2^-127, c up to 1.5) give the same."""
    from torch_fused.optim import sharded as S

    gen = torch.Generator().manual_seed(3)
    g = torch.randn(2, 5, 12, generator=gen)
    c = torch.rand(2, 12, generator=gen) + 0.5
    r0 = torch.rand(2, 5, generator=gen) + 0.5
    r1, p1 = S._row_values(g, c, r0, 1e-8)
    r2, p2 = S._row_values(g * 2.0**100, c, r0, 1e-8)
    assert bool(torch.isfinite(r2).all() and torch.isfinite(p2).all())
    torch.testing.assert_close(r2 * 2.0**100, r1, rtol=1e-6, atol=0)
    torch.testing.assert_close(p2, p1, rtol=1e-5, atol=0)
    g = g / g.abs().amax() * 1.5  # entries up to 1.5 * 2^127 = 2.6e38 below
    ones_r, ones_c = torch.ones(2, 5), torch.ones(2, 12)
    for c_k, r_k, r_scale in ((ones_c, ones_r, 1.0), (c, r0, 2.0**-127)):
        r1, p1 = S._row_values(g, c_k, r_k, 1e-8)
        r2, p2 = S._row_values(g * 2.0**127, c_k, r_k * r_scale, 1e-8)
        assert bool(torch.isfinite(r2).all() and torch.isfinite(p2).all())
        # r near 2^-127 is subnormal in fp32 (about 23 bits at 1e-39)
        torch.testing.assert_close(r2 * 2.0**127, r1, rtol=1e-5, atol=0)
        torch.testing.assert_close(p2, p1, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spectral", [False, True])
def test_world_of_one_step_of_gradients_near_the_fp32_maximum(device, spectral):
    """The sharded step at a world of 1 (the fake process group: an all-reduce returns its
    input) on entries up to 2.6e38 (the plain run: its PyTorch ops; on a Triton device: the
    kernels, rows of 80 on the two-pass path in the interpreter run) is the step of the same
    gradient scaled by 2^-127 (exact): a normalized step. A positive G and v make the power
    pass's G (c v) overflow unless r is applied first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_fused.optim import sinkgd_step
    from torch_fused.optim.sharded import sinkgd_step_sharded

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 48), (6, 80)]
    ws = [torch.randn(sh, generator=gen).to(device) for sh in shapes]
    gs = [torch.rand(sh, generator=gen) + 0.25 for sh in shapes]
    gs = [(g / g.amax() * 1.5).to(device) for g in gs]
    vs = [torch.rand(1, sh[1], generator=gen) + 0.5 for sh in shapes]
    vs = [(v / v.norm()).to(device) for v in vs]
    cfg = dict(lr=0.5, sinkhorn_iters=3, spectral_norm=spectral)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        ps = [DTensor.from_local(w.clone(), mesh, [Shard(0)], run_check=False) for w in ws]
        dgs = [DTensor.from_local(g * 2.0**127, mesh, [Shard(0)], run_check=False) for g in gs]
        vecs = [v.clone() for v in vs] if spectral else None
        sinkgd_step_sharded(ps, dgs, spectral_vecs=vecs, **cfg)
    finally:
        dist.destroy_process_group()
    ref = [w.clone() for w in ws]
    ref_vecs = [v.clone() for v in vs] if spectral else None
    sinkgd_step(ref, gs, spectral_vecs=ref_vecs, **cfg)
    for k, (p, want, w) in enumerate(zip(ps, ref, ws)):
        got = p.to_local()
        assert bool(torch.isfinite(got).all()), f"matrix {k}: a non-finite W"
        # W's own rounding is the floor; a skipped step (W unchanged) misses by the whole step
        torch.testing.assert_close(got - w, want - w, rtol=1e-4, atol=8 * torch.finfo(torch.float32).eps,
                                   msg=lambda m: f"matrix {k}: {m}")
    for k, (v, want) in enumerate(zip(vecs or [], ref_vecs or [])):
        torch.testing.assert_close(v, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"warm-start vector {k}: {m}")
