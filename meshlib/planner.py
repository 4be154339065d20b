"""The planner: which parallelism, in which order, for this model on these devices (`search`).

`search(shape, devices=, batch=, seq=, profile=)` tries the meshes the devices factor into (tp inside a
node, cp, ep for experts, pp, the rest dp), for each the microbatch size, the pipeline schedule and its
chunks, the cp method, and every ZeRO level with the least recompute that lets it fit (none ->
selective -> block: more recompute at the same ZeRO level only adds time; a higher ZeRO level can be
faster, its optimizer step sharded and its gathers behind compute). Each
candidate's step is the closed-form workload (`meshlib.transformer.workload`) timed by `meshlib.predict`
with the schedule's published bubble; a skeleton whose best case (its busiest rank's compute, stretched by the
bubble) cannot beat the candidates kept so far is skipped, and so is one whose least memory (ZeRO-3 and the
most recompute) does not fit.
What does not divide is never tried. The result is ranked by predicted step time, each candidate with
its prediction and, for the best, why each axis is there, in the order of the field's decision guide
(recompute, then dp and ZeRO, then tp, then pp, then ep and cp): what the plan would need or lose
without it. `exhaustive=True` tries everything instead (every ZeRO level with every recompute mode,
every microbatch size, schedules and chunks), for checking the search against it.

Example:
    >>> from meshlib.transformer import ModelShape
    >>> from meshlib.devices import A100
    >>> shape = ModelShape(layers=24, hidden=2048, heads=16, ffn=8192, vocab=50304)
    >>> best = search(shape, devices=16, batch=64, seq=2048, profile=A100)[0]
    >>> best.config.dp * best.config.tp * best.config.pp * best.config.cp == 16
    True
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from ._table import human_bytes
from .devices import DeviceProfile, device_profile
from .predict import Prediction, predict
from .simulation import bubble_formula
from .transformer import ModelShape, StepConfig, compute_bound, workload

__all__ = ["Candidate", "MESHLIB_RUNTIME", "SIMPLER", "search"]

# how meshlib's torch runtime runs a step, where that changes its time (`transformer.StepConfig`'s flags):
# fused attention (SDPA), gradient reductions and ZeRO's gathers overlapping compute (hooks, FSDP2) but
# ZeRO-1's gathers (its optimizer step moves them) and every gradient reduction under a pipeline (its
# schedule runs every backward with the sync off: the sums follow a stage's last backward or the schedule),
# tensor-parallel collectives waiting for their matrix products, autograd's add summing each microbatch's
# weight gradients into the held ones, receive buffers for every microbatch
# (torch 2.13's, the input's and the output gradient's; the torch backend says what the installed torch keeps:
# `meshlib_torch.planner.torch_runtime`)
MESHLIB_RUNTIME = {"flash": True, "dp_overlap": True, "pp_dp_overlap": False, "zero1_overlap": "backward",
                   "tp_overlap": "none", "fused_elementwise": False, "fused_accumulation": False, "recv_buffers": 2,
                   "main_grads": False}  # fmt: skip
GIB = 1 << 30
_RECOMPUTE = ("none", "selective", "block")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A configuration that fits, its predicted step, and (for the best ones) why each axis is there."""

    config: StepConfig
    prediction: Prediction
    why: tuple[str, ...] = field(default=())

    @property
    def mesh(self) -> str:
        c = self.config
        return ",".join(f"{a}={n}" for a, n in (("pp", c.pp), ("dp", c.dp), ("cp", c.cp), ("ep", c.ep), ("tp", c.tp))
                        if n > 1) or "dp=1"  # fmt: skip


def search(
    shape: ModelShape, /, *, devices: int, batch: int, seq: int, profile: DeviceProfile | str,
    device_memory: float | None = None, dtype: str = "bfloat16", top: int = 10, exhaustive: bool = False,
    runtime: dict | None = None, explain: int = 1,
) -> list[Candidate]:  # fmt: skip
    """The `top` configurations of `shape` on `devices` devices of `profile` for a step of `batch` sequences
    of `seq` tokens that fit `device_memory` bytes per device (default: the profile's), fastest first (a plan
    with another parallel axis must be `SIMPLER` faster per axis to rank above one without); the first
    `explain` say why each axis is there (`Candidate.why`). Raises ValueError, naming the smallest need, when
    none fits."""
    profile = device_profile(profile)
    _check(shape, devices, batch, seq)
    space = _Space(shape, devices, batch, seq, profile, float(device_memory or profile.memory), dtype,
                   {**MESHLIB_RUNTIME, **(runtime or {})}, exhaustive)  # fmt: skip
    ranked = space.best(max(top, RESIMULATED))
    if not ranked:
        need = f"; the least any configuration needs is {human_bytes(space.tight)}" if space.tight < math.inf else ""
        raise ValueError(
            f"no configuration of this model fits {devices} device{'s' if devices > 1 else ''} of "
            f"{human_bytes(space.memory)} at batch {batch} x seq {seq}{need}. Fix: more devices, a smaller batch or "
            "sequence, or devices with more memory"
        )
    timed = sorted(((_simulated(c, space), c) for c in ranked), key=lambda sc: _rank(sc[0]))[:top]
    return [Candidate(c.config, c.prediction, _why(quick, space, first=i == 0)) if i < explain else c
            for i, (c, quick) in enumerate(timed)]  # fmt: skip


SIMPLER = 0.01  # the predicted gain an extra parallel axis must bring to rank first (within the model's error)
RESIMULATED = 10  # the search's best this many, ranked by the schedule's published bubble, are simulated


def _simulated(cand: Candidate, space: _Space) -> Candidate:
    """`cand` predicted with its pipeline simulated (the busiest stage's times on the schedule's own order,
    sends included), not the published bubble the search ranks by: the returned plans are ranked so."""
    if cand.config.pp == 1:
        return cand
    w = workload(space.shape, cand.config, batch=space.batch, seq=space.seq)
    return Candidate(cand.config, predict(w, space.profile))


def _rank(cand: Candidate) -> tuple:
    """Step time, each axis beyond dp costing `SIMPLER`; then less recompute, then a lower ZeRO level."""
    c = cand.config
    axes = sum(n > 1 for n in (c.tp, c.pp, c.cp, c.ep))
    return cand.prediction.step_time * (1 + SIMPLER * axes), _RECOMPUTE.index(c.recompute), c.zero


class _Space:
    """The configurations of one search: skeletons ranked by their bound, searched branch-and-bound."""

    def __init__(self, shape, devices, batch, seq, profile, memory, dtype, run, exhaustive):
        self.shape, self.batch, self.seq, self.profile = shape, batch, seq, profile
        self.memory, self.dtype, self.run, self.exhaustive = memory, dtype, run, exhaustive
        self.tight = math.inf  # the least memory any tried configuration needed
        self.skeletons = sorted(_skeletons(shape, devices, batch, seq, profile, dtype, run, exhaustive))
        self._tried: dict[tuple, list[Candidate]] = {}

    def best(self, top: int, mesh=lambda mesh: True, keep=lambda cand: True) -> list[Candidate]:
        """The `top` best candidates whose mesh `(tp, pp, cp, ep, dp)` passes `mesh` and that pass `keep`."""
        kept: list[tuple] = []  # a max-heap of the best `top` by `_rank` (negated), with an order for ties
        order = itertools.count()
        for bound, m, b, sched in self.skeletons:
            if not mesh(m):
                continue
            if len(kept) >= top and bound > -kept[0][0][0] and not self.exhaustive:
                break  # the skeletons come in the order of their bounds: none of the rest can do better
            for cand in self._candidates(m, b, sched):
                if keep(cand):
                    heapq.heappush(kept, (tuple(-x for x in _rank(cand)), -next(order), cand))
                    if len(kept) > top:
                        heapq.heappop(kept)
        return [k[-1] for k in sorted(kept, key=lambda k: (tuple(-x for x in k[0]), -k[1]))]

    def _candidates(self, mesh, b, sched) -> list[Candidate]:
        key = (mesh, b, sched)
        if key not in self._tried:
            found, need = _fitting(self.shape, mesh, b, sched, self.batch, self.seq, self.profile, self.memory,
                                   self.dtype, self.run, self.exhaustive)  # fmt: skip
            self.tight = min(self.tight, need)
            self._tried[key] = found
        return self._tried[key]


# -- what is tried ----------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check(shape: ModelShape, devices: int, batch: int, seq: int) -> None:
    bad = [f"{k}={v!r}" for k, v in (("devices", devices), ("batch", batch), ("seq", seq))
           if not isinstance(v, int) or isinstance(v, bool) or v < 1]  # fmt: skip
    if bad:
        raise ValueError(f"search: {', '.join(bad)} must be whole numbers >= 1")


def _meshes(shape: ModelShape, devices: int, seq: int, node: int):
    """(tp, pp, cp, ep, dp) whose product is `devices`: tp within a node dividing the heads, cp cutting the
    sequence into 2·cp equal chunks (head-tail), ep dividing the experts, pp at most the layers."""
    for tp in _divisors(devices):
        if tp > node or shape.heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
            continue
        for cp in _divisors(devices // tp):
            if cp > 1 and (seq % (2 * cp * tp) or cp > 64):
                continue
            for ep in _divisors(devices // (tp * cp)) if shape.experts else (1,):
                if ep > 1 and shape.experts % ep:
                    continue
                for pp in _divisors(devices // (tp * cp * ep)):
                    if pp <= shape.layers:
                        yield tp, pp, cp, ep, devices // (tp * cp * ep * pp)


def _schedules(shape: ModelShape, pp: int, m: int, exhaustive: bool):
    """The (schedule, chunks) worth pricing for `pp` ranks and `m` microbatches, each one torch runs: its
    Schedule1F1B needs m >= pp, and with fewer microbatches GPipe runs the same order."""
    if pp == 1:
        yield "1f1b", 1
        return
    if m >= pp:
        yield "1f1b", 1
    if exhaustive or m < pp:
        yield "gpipe", 1
    for v in (2, 3, 4, 6, 8) if exhaustive else (2, 4, 8):
        if pp * v <= shape.layers + 2 and m % pp == 0:  # the first and last stage may hold no layer
            yield "interleaved-1f1b", v
    if m >= pp:
        yield "zb-h1", 1
    if m >= 2 * pp - 1 and 2 * pp <= shape.layers + 2:
        yield "zbv", 2


def _skeletons(shape, devices, batch, seq, profile, dtype, run, exhaustive):
    """(a lower bound on the step time, mesh, microbatch size, (schedule, chunks)) for every skeleton: its
    busiest rank's compute (`transformer.compute_bound`) stretched by the schedule's bubble."""
    for mesh in _meshes(shape, devices, seq, profile.devices_per_node):
        tp, pp, cp, ep, dp = mesh
        if batch % (dp * ep):
            continue
        per = batch // (dp * ep)
        for b in _divisors(per):
            if not exhaustive and b > 16:
                break
            m = per // b
            for sched in _schedules(shape, pp, m, exhaustive):
                config = StepConfig(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, sp=tp > 1, microbatch=b, schedule=sched[0],
                                chunks=sched[1], dtype=dtype, **run)  # fmt: skip
                bubble = bubble_formula(sched[0], pp, m, sched[1] if sched[1] > 1 else None) if pp > 1 else 0.0
                yield compute_bound(shape, config, batch=batch, seq=seq, profile=profile) / (1 - bubble), mesh, b, sched


def _fitting(shape, mesh, b, sched, batch, seq, profile, memory, dtype, run, exhaustive) -> tuple[list, float]:
    """The candidates of one skeleton that fit (per cp method, every ZeRO level with the least recompute that
    lets it fit), and the least memory any of its configurations needed."""
    tp, pp, cp, ep, dp = mesh
    methods = ("ring",) if cp == 1 else ("ring", "all-gather") + (
        ("all-to-all",) if shape.heads % (cp * tp) == 0 and shape.kv_heads % (cp * tp) == 0 else ())
    split = sched[0] in ("zb-h1", "zbv")
    modes = ("none",) if split else ("none", "selective", "block")
    zeros = (0, 1, 2, 3) if dp * cp * ep > 1 else (0,)
    make = lambda **kw: StepConfig(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, sp=tp > 1, microbatch=b, schedule=sched[0],  # noqa: E731
                               chunks=sched[1], dtype=dtype, **run, **kw)  # fmt: skip
    least = max(s.memory for s in workload(shape, make(zero=zeros[-1], recompute=modes[-1]), batch=batch,
                                           seq=seq).stages)  # fmt: skip
    out: list[Candidate] = []
    if least > memory and not exhaustive:  # the least memory this skeleton can take does not fit: nothing does
        return out, least
    for method in methods:
        fitted: set[int] = set()  # ZeRO levels that fit with less recompute: more recompute there only adds time
        for mode in modes:
            for zero in zeros:
                if zero in fitted and not exhaustive:
                    continue
                w = workload(shape, make(zero=zero, recompute=mode, cp_method=method), batch=batch, seq=seq)
                need = max(s.memory for s in w.stages)
                least = min(least, need)
                if need <= memory:
                    fitted.add(zero)
                    out.append(Candidate(make(zero=zero, recompute=mode, cp_method=method),
                                         predict(w, profile, simulate_pipeline=False)))  # fmt: skip
            if len(fitted) == len(zeros) and not exhaustive:
                break
    return out, least


# -- why --------------------------------------------------------------------------------------------------
def _why(best: Candidate, space: _Space, first: bool = True) -> tuple[str, ...]:
    """Each axis and option of `best`, in the decision guide's order, with what the plan would need or lose
    without it: the best plan the search finds with that axis or option otherwise (`first`: `best` is the
    search's first, which a faster plan only trails for the axes it adds)."""
    c, t = best.config, best.prediction.step_time
    shape = space.shape
    out = [f"model state with mixed-precision Adam: {_gib(16 * shape.params())} in all (16 bytes a parameter); "
           f"each device holds {_gib(space.memory)}"]  # fmt: skip
    if c.recompute == "none":
        out.append("recompute: not needed, the activations fit")
    else:
        alt = space.best(1, keep=lambda x: x.config.recompute == "none")
        worse = _slower(alt[0], t, first) if alt else ""
        out.append(f"recompute={c.recompute}: " + (f"the best plan without recompute ({alt[0].mesh}) is {worse}"
                                                   if alt else "no plan fits without it"))  # fmt: skip
    data = [f"{a}={n}" for a, n in (("dp", c.dp), ("cp", c.cp), ("ep", c.ep)) if n > 1] or ["dp=1"]
    over = "x".join(data)
    if c.zero:
        alt = space.best(1, keep=lambda x: x.config.zero < c.zero)
        lower = (f"the best plan with less ZeRO ({alt[0].mesh}, ZeRO-{alt[0].config.zero}) is "
                 f"{_slower(alt[0], t, first)}" if alt else "no plan with less fits")  # fmt: skip
        out.append(f"ZeRO-{c.zero} over the data ranks ({over}): {_gib(best.prediction.memory)} per rank; {lower}")
    else:
        out.append(f"data ranks {over}, ZeRO-0 (the model state fits whole): {_gib(best.prediction.memory)} per rank")
    for axis in ("tp", "pp", "ep", "cp"):
        out.append(_axis_line(axis, c, t, space, first))
    return tuple(out)


def _slower(alt: Candidate, t: float, first: bool = True) -> str:
    gap = alt.prediction.step_time / t - 1
    if gap < 0 and first:  # ranked below the first for its extra axes: faster by less than `SIMPLER` an axis
        return f"{-gap:.1%} faster, less than the {SIMPLER:.0%} per axis an extra axis must gain"
    if gap < 0:  # explaining a plan the closed form ranks below the first (`search(explain=)`)
        return f"{-gap:.1%} faster by the closed form" if gap > -0.1 else f"{-gap:.0%} faster by the closed form"
    return f"{gap:.1%} slower" if gap < 0.1 else f"{gap:.0%} slower"


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"


def _axis_line(axis: str, c: StepConfig, t: float, space: _Space, first: bool = True) -> str:
    n = getattr(c, axis)
    if axis == "ep" and not space.shape.experts:
        return "ep: not a mixture-of-experts model"
    index = {"tp": 0, "pp": 1, "cp": 2, "ep": 3}[axis]
    if n > 1:
        alt = space.best(1, mesh=lambda m: m[index] < n)
        if not alt:
            return f"{axis}={n}: no plan with less {axis} fits"
        return (f"{axis}={n}: the best plan with {axis}={getattr(alt[0].config, axis)} ({alt[0].mesh}) is "
                f"{_slower(alt[0], t, first)}")  # fmt: skip
    alt = space.best(1, mesh=lambda m: m[index] > 1)
    if not alt:
        return f"{axis}: not needed (no plan with {axis} > 1 fits or divides)"
    return (f"{axis}: not needed; the best plan with {axis}={getattr(alt[0].config, axis)} ({alt[0].mesh}) is "
            f"{_slower(alt[0], t, first)}")  # fmt: skip
