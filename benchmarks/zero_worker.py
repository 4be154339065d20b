"""The rank-side jobs of the ZeRO benchmark (run by bench_zero.py through a RankPool, not by hand).

Each function runs on every rank of a gloo `RankPool` and returns plain data:

- `comm_bytes`: one whole training step of the compiled model at one ZeRO
  level, counted at meshlib's collective layer (`COUNTER`), beside the plan's
  own data-parallel records.
- `peak`: the peak of live tensor bytes over one forward and backward, with
  the model state counted as the baseline, by `PeakTracker`.
- `race`: meshlib's `parallelize(..., zero=3)` against the same model with
  FSDP2's `fully_shard` applied by hand (or `zero=0` against torch's DDP, and
  against meshlib summing each gradient alone), from the same initial values;
  checks all take the same first steps, then times them alternately.

They live in their own module because a RankPool job pickles by qualified name.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from meshlib import Mesh, Precision
from meshlib_torch import COUNTER, PeakTracker, data, models, parallelize
from meshlib_torch.runtime import dist as mdist
from meshlib_torch.runtime.materialize import init_full

LOSS = "cross_entropy"  # the counter's provenance for the loss's own forward reductions


def _init(cfg):
    cls = models.model_class(cfg)
    return lambda name: cls.param_init(name, cfg)


def _build(model: str, mesh: str, batch: int, seq: int, **kw):
    cfg, m = models.config(model), Mesh.parse(mesh)
    example = data.batch(0, batch_size=batch, seq_len=seq)
    precision = kw.pop("precision", "")
    par = parallelize(
        models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=example, init=_init(cfg),
        precision=Precision.parse(precision) if precision else None, **kw,
    )  # fmt: skip
    return par, example


def _step(par, opt, batch) -> float:
    return par.train_step(batch, opt)  # the one training loop, for every mesh


# -- (a) bytes -------------------------------------------------------------------------------
def comm_bytes(model: str, mesh: str, zero: int, batch: int, seq: int) -> dict:
    """Counted bytes of one step (forward, backward, update) after a warm-up step, and the plan's."""
    par, example = _build(model, mesh, batch, seq, zero=zero)
    opt = par.optimizer(lr=1e-3)
    _step(par, opt, example)  # creates the optimizer state; FSDP's lazy init
    COUNTER.reset()
    _step(par, opt, example)
    counted = [[ph, kind, axis, where, n] for (ph, kind, axis, where), n in COUNTER.by_source.items()]
    planned = [[c.phase, c.kind, list(c.axes), c.op, c.total_bytes, c.group] for c in par.plan.collectives]
    psi = sum(math.prod(par.compiled.local_param_shape(n)) for n in par.compiled.traced.params)
    return {"counted": counted, "planned": planned, "psi": psi}


# -- (c) peak memory ---------------------------------------------------------------------------
def peak(model: str, mesh: str, batch: int, seq: int, zero: int, recompute: str, sp: bool) -> int:
    """Peak live tensor bytes on this rank over one forward + backward, after one full step
    (`PeakTracker`, which also sees FSDP2's in-place storage resizes)."""
    par, example = _build(model, mesh, batch, seq, zero=zero, recompute=recompute, sequence_parallel=sp)
    opt = par.optimizer(lr=1e-3)
    _step(par, opt, example)
    state = list(par.parameters()) + list(par.buffers()) + list(opt.master.values())
    state += [t for s in opt.inner.state.values() for t in s.values() if torch.is_tensor(t)]
    with PeakTracker() as tracker:
        tracker.baseline(state)
        par(*example).backward()
    opt.zero_grad()
    return tracker.peak


# -- (d) step time against hand-written fully_shard ---------------------------------------------
def _native(cfg, dp: int, seed: int = 0, ddp: bool = False) -> torch.nn.Module:
    """The plain model with the values meshlib builds, FSDP2 per TransformerBlock and on the root (`ddp`:
    in torch's DistributedDataParallel, default buckets, instead)."""
    from torch.distributed.fsdp import fully_shard

    model = models.build(cfg, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_full(name, tuple(p.shape), p.dtype, _init(cfg), seed))
    model.init_buffers()
    if ddp:
        return torch.nn.parallel.DistributedDataParallel(model)
    dm = mdist.device_mesh(Mesh(dp=dp))
    for block in model.layers:
        fully_shard(block, mesh=dm, reshard_after_forward=True)
    fully_shard(model, mesh=dm, reshard_after_forward=True)
    return model


def _native_step(model, opt, tokens, targets) -> float:
    loss = model(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _global_mean(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _timed(fn, steps: int, batches) -> float:
    """Seconds per step on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        fn(batches[i % len(batches)])
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / steps


def race(model: str, dp: int, batch: int, seq: int, rounds: int, steps: int, lr: float = 1e-3, zero: int = 3) -> dict:
    """meshlib at `zero` against torch's own: ZeRO-3 against hand-written fully_shard; ZeRO-0 and ZeRO-1
    against DDP, and against meshlib with a bucket per parameter (each gradient summed, or reduce-scattered
    and gathered, alone, as before buckets). The same first two losses, then alternated timing."""
    torch.use_deterministic_algorithms(False)  # as under plain torchrun; the same for both sides
    cfg = models.config(model)
    rank, n = dist.get_rank(), dist.get_world_size()
    batches = [data.batch(i, batch_size=batch, seq_len=seq) for i in range(4)]
    per = batch // n
    local = [tuple(t[rank * per : (rank + 1) * per] for t in b) for b in batches]
    pars = {"ours": _build(model, f"dp={dp}", batch, seq, zero=zero)[0]}
    if zero < 2:
        from meshlib_torch.compiler import buckets

        saved = buckets.FIRST_BUCKET_BYTES, buckets.BUCKET_BYTES
        buckets.FIRST_BUCKET_BYTES = buckets.BUCKET_BYTES = 1  # every gradient its own bucket
        try:
            pars["alone"] = _build(model, f"dp={dp}", batch, seq, zero=zero)[0]
        finally:
            buckets.FIRST_BUCKET_BYTES, buckets.BUCKET_BYTES = saved
    native = _native(cfg, dp, ddp=zero < 2)
    opt_native = torch.optim.AdamW(
        native.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=False
    )  # meshlib's defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01
    opts = {k: par.optimizer(lr=lr) for k, par in pars.items()}
    sides = {k: (lambda b, k=k: _step(pars[k], opts[k], batches[b])) for k in pars}
    sides["native"] = lambda b: _native_step(native, opt_native, *local[b])
    # the same first step: loss before it, and loss after it (which checks the update too)
    losses = {k: [fn(0), fn(1)] for k, fn in sides.items() if k != "native"}
    losses["native"] = [_global_mean(sides["native"](0)), _global_mean(sides["native"](1))]
    times = _alternated(sides, rounds, steps, len(batches))
    return {"losses": losses, "times": times, "layers": cfg.n_layers, "dim": cfg.dim}


def _alternated(sides: dict, rounds: int, steps: int, batches: int) -> dict:
    """Seconds per step of each side, one timing of each per round, the order rotated every round."""
    times = {k: [] for k in sides}
    order = list(sides.items())
    for r in range(rounds):
        for name, fn in order[r % len(order) :] + order[: r % len(order)]:
            times[name].append(_timed(fn, steps, range(batches)))
    return times


# -- (g) clipping under ZeRO-1 ---------------------------------------------------------------------
def clipping(model: str, dp: int, batch: int, seq: int, rounds: int, steps: int) -> dict:
    """One ZeRO-1 model and optimizer, stepped three ways, alternated: no clipping; clipped with the norm
    taken from the optimizer's reduce-scattered pieces (`clip_grad_norm_(..., opt=)`, as `train_step`
    clips: one scalar all-reduce); clipped with the norm of the parameters' own gradients, which are
    Partial over dp, so each is all-reduced first (the cost before the pieces were used)."""
    torch.use_deterministic_algorithms(False)
    par = _build(model, f"dp={dp}", batch, seq, zero=1)[0]
    opt = par.optimizer(lr=1e-3)
    batches = [data.batch(i, batch_size=batch, seq_len=seq) for i in range(4)]

    def step(b, how):
        par(*batches[b]).backward()
        if how == "pieces":
            par.clip_grad_norm_(1e-3, opt=opt)
        elif how == "each":
            par.clip_grad_norm_(1e-3)
        opt.step()
        opt.zero_grad()

    sides = {how: (lambda b, how=how: step(b, how)) for how in ("none", "pieces", "each")}
    for fn in sides.values():
        fn(0)  # warm-up; the optimizer state
    return {"times": _alternated(sides, rounds, steps, len(batches))}
