"""The rank-side jobs of the context-parallel benchmark (run by bench_context.py through a RankPool, not by hand).

Each function runs on every rank of a gloo `RankPool` and returns plain data:

- `long_round`: one round of the long-sequence race: `steps` timed training steps of either the model
  compiled on `Mesh(cp=4)` or the model as written in one process (a pool of one rank), built once per
  worker and kept between rounds, so the parent can alternate the two; `long_peak` the peak tensor bytes
  of one forward + backward of either.
- `methods_race`: the same model compiled with each `cp_method` on the same 4 ranks, from the same initial
  values; checks they take the same first step, then times them in rotation (ABC, BCA, CAB, ...).
- `overlap`: the ring's hops against its blocks, at the level of the per-shard attention: per round the
  hops alone, the blocks alone, the ring with blocking hops and the ring itself (asynchronous hops),
  forward and backward timed apart.

They live in their own module because a RankPool job pickles by qualified name.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from meshlib import Mesh
from meshlib_torch import PeakTracker, data, lax, models, parallelize
from meshlib_torch.attention import ring_attention
from meshlib_torch.attention.inputs import check, host_index
from meshlib_torch.attention.local import attend_shard, finish
from meshlib_torch.attention.ring import shard_problem
from meshlib_torch.runtime import dist as mdist
from meshlib_torch.runtime.materialize import init_full
from meshlib_torch.spmd.eager import EagerBackend
from meshlib_torch.spmd.region import Region

_BUILT: dict = {}  # (side, model, seq, method) -> (step function, state tensors), kept between jobs


def _init(cfg):
    cls = models.model_class(cfg)
    return lambda name: cls.param_init(name, cfg)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn, steps: int) -> float:
    """Seconds per call of `fn` on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return _slowest(time.perf_counter() - start) / steps


# -- (1) the long sequence: cp=4 against one process -------------------------------------------------
def _compiled(cfg, mesh: str, method: str, batch):
    m = Mesh.parse(mesh)
    par = parallelize(models.build(cfg), mesh=m, rules=models.default_rules(cfg, m), example_inputs=batch,
                      init=_init(cfg), cp_method=method)  # fmt: skip
    opt = par.optimizer(lr=1e-3)
    state = lambda: list(par.parameters()) + list(par.buffers()) + _opt_state(opt.inner)
    return (lambda: float(par.train_step(batch, opt))), (lambda: par(*batch)), state


def _single(cfg, batch):
    """The model as written, the values `parallelize` builds from `init`, on this process alone."""
    model = models.build(cfg, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_full(name, tuple(p.shape), p.dtype, _init(cfg), 0))
    model.init_buffers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step():
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    state = lambda: list(model.parameters()) + list(model.buffers()) + _opt_state(opt)
    return step, (lambda: model(*batch)), state


def _opt_state(opt) -> list:
    return [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]


def _built(side: str, model: str, seq: int, method: str):
    key = (side, model, seq, method)
    if key not in _BUILT:
        torch.use_deterministic_algorithms(False)  # as under plain torchrun; the same for both sides
        cfg = models.config(model, max_seq_len=seq)
        batch = data.batch(0, batch_size=1, seq_len=seq)
        made = _single(cfg, batch) if side == "single" else _compiled(cfg, side, method, batch)
        _BUILT.clear()  # one side at a time per worker: free the other's activations and state
        _BUILT[key] = made + ([made[0]()],)  # the first step's loss, for the parent to compare
    return _BUILT[key]


def forget() -> None:
    """Drop the model this worker keeps between rounds (its state and activations)."""
    _BUILT.clear()


def long_round(side: str, model: str, seq: int, method: str, steps: int) -> dict:
    """`steps` timed steps of `side` ("single" or a mesh such as "cp=4"), after its first (untimed) step."""
    step, _, _, first = _built(side, model, seq, method)
    torch.use_deterministic_algorithms(False)
    return {"seconds": _timed(step, steps), "first_loss": first[0]}


def long_peak(side: str, model: str, seq: int, method: str) -> dict:
    """Peak live tensor bytes of one forward + backward (`PeakTracker`), model and optimizer state counted
    as the baseline, and that state's bytes."""
    _, forward, state, _ = _built(side, model, seq, method)
    torch.use_deterministic_algorithms(False)
    tracker = PeakTracker()
    with tracker:
        tracker.baseline(state())
        base = tracker.live
        forward().backward()
    return {"peak": tracker.peak, "state": base, "rank": dist.get_rank()}


# -- (2) ring against all-gather against all-to-all ----------------------------------------------------
def methods_race(model: str, seq: int, methods: tuple, rounds: int, steps: int) -> dict:
    """Each method's first loss and peak (max over ranks), then `rounds` rounds timing `steps` steps of
    each, in rotation: round r starts at method r mod 3."""
    torch.use_deterministic_algorithms(False)
    _BUILT.clear()
    cfg = models.config(model, max_seq_len=seq)
    batch = data.batch(0, batch_size=1, seq_len=seq)
    built = {m: _compiled(cfg, "cp=4", m, batch) for m in methods}
    losses = {m: fns[0]() for m, fns in built.items()}
    peaks = {}
    for m, (_, forward, state) in built.items():
        tracker = PeakTracker()
        with tracker:
            tracker.baseline(state())
            forward().backward()
        peaks[m] = int(_slowest(float(tracker.peak)))
    times: dict = {m: [] for m in methods}
    for r in range(rounds):
        for m in methods[r % len(methods) :] + methods[: r % len(methods)]:
            times[m].append(_timed(built[m][0], steps))
    return {"losses": losses, "times": times, "peaks": peaks}


# -- (3) the ring's hops against its blocks ------------------------------------------------------------
def _region(mesh: Mesh) -> Region:
    return Region(mesh, EagerBackend(mesh, mdist.device_mesh(mesh)), check_vma=False)


def _ring(q, k, v, hops: str):
    """The ring's loop (`attention.ring`) with its hops `"async"` (`ring_attention` itself), `"blocking"`
    (`lax.ppermute`), `"none"` (every block against this rank's own keys: the compute alone) or `"only"`
    (the hops alone, no block)."""
    if hops == "async":
        return ring_attention(q, k, v, axis="cp")
    shards = check("ring", q, k, v, axis="cp", causal=False, mask=None, doc_ids=None, scale=None, layout="contiguous")
    p = shard_problem(q, k, shards, host_index("cp", "ring"), False, None, None, None, "cp")
    n, kv = shards.cp, torch.stack([k, v])
    ring = [(j, (j + 1) % n) for j in range(n)]
    if hops == "only":
        for _ in range(n - 1):
            kv = lax.ppermute(kv, "cp", ring)
        return kv
    acc = [None] * len(shards.starts(p.rank))
    for step in range(n):
        attend_shard(p, acc, kv, (p.rank - step) % n)
        if hops == "blocking" and step + 1 < n:
            kv = lax.ppermute(kv, "cp", ring)
    return finish(p, acc, q.dtype)


def _phases(region: Region, qkv: list, hops: str) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one `_ring`, each on the slowest rank."""
    leaves = [t.detach().requires_grad_() for t in qkv]
    dist.barrier()
    start = time.perf_counter()
    with region.entered():
        out = _ring(*leaves, hops)
    forward = _slowest(time.perf_counter() - start)
    ct = torch.ones_like(out)
    dist.barrier()
    start = time.perf_counter()
    out.backward(ct)
    return forward, _slowest(time.perf_counter() - start)


VARIANTS = ("only", "none", "blocking", "async")


def overlap(cp: int, heads: int, length: int, dim: int, rounds: int) -> dict:
    """Per variant of `_ring` (`VARIANTS`), its (forward, backward) seconds (slowest rank) in each of `rounds`
    rounds, the variants rotated each round; q, k, v (1, heads, length, dim) per rank, fp32, full
    (non-causal) attention, so every block is whole and every rank does the same work."""
    torch.use_deterministic_algorithms(False)
    _BUILT.clear()
    region = _region(Mesh(cp=cp))
    g = torch.Generator().manual_seed(dist.get_rank())
    qkv = [torch.randn(1, heads, length, dim, generator=g) for _ in range(3)]
    for hops in VARIANTS:  # warm-up: the groups, the allocator, the first hop
        _phases(region, qkv, hops)
    got: dict = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for hops in VARIANTS[r % 4 :] + VARIANTS[: r % 4]:
            got[hops].append(_phases(region, qkv, hops))
    return {"rounds": got, "kv_bytes": 2 * heads * length * dim * 4}
