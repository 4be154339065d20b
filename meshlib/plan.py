"""`Plan`: the frozen record of how a model runs on a mesh.

It holds the mesh, each tensor's spec, and typed room for what the compiler
and runtime add: every collective with its provenance and bytes, pipeline
stages, the schedule, the ZeRO level, precision, recompute and memory.
It round-trips through JSON exactly, diffs readably, and prints as a table.

Example:
    >>> plan = Plan(Mesh(dp=2, tp=2), specs={"w": P("tp", None)})
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field

from ._table import Table, human_bytes
from .mesh import Mesh
from .predict import Prediction
from .spec import P
from .workload import StageCompute

__all__ = ["Plan", "Collective", "Stage", "Boundary", "Precision", "Memory", "Kept", "COLLECTIVE_KINDS"]

# "host_sync": a read of device values to the host that the step waits on (dropless expert dispatch reads
# its split sizes), its bytes those read
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "host_sync")
PHASES = ("forward", "recompute", "backward", "optimizer", "step")


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective per step: what, over which axes, how many bytes, and why."""

    kind: str
    axes: tuple[str, ...]
    bytes: int  # logical bytes per rank per occurrence
    node: str = ""  # the graph node it serves
    op: str = ""  # the op that needed it
    source: str = ""  # file:line of the user code
    reason: str = ""  # the rule or placement change that put it there
    phase: str = "forward"
    count: int = 1  # occurrences per step (microbatches, layers folded together)
    group: int = 1  # ranks in the collective
    consumer: str = ""  # the graph node that needed the new layout
    pp_rank: int = -1  # with a pipeline, the pp coordinate of the ranks that run it (-1: every rank)

    def __post_init__(self):
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {self.kind!r} is not one of {COLLECTIVE_KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"collective phase {self.phase!r} is not one of {PHASES}")

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count

    @property
    def bus_bytes(self) -> float:
        """Bytes each rank sends in a ring: 2(n-1)/n of the payload for an all-reduce, (n-1)/n otherwise;
        a point-to-point send moves its whole payload, and so does an all-to-all of uneven blocks
        (`lax.all_to_all_v`), whose records already hold only the rows that leave the rank."""
        if self.kind == "send_recv" or self.op.endswith("all_to_all_v"):
            return float(self.total_bytes)
        n = self.group
        factor = 2.0 if self.kind == "all_reduce" else 1.0
        return factor * self.total_bytes * (n - 1) / n if n > 1 else 0.0


@dataclass(frozen=True, slots=True)
class Boundary:
    """An activation that crosses a pipeline stage boundary, per microbatch."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    grad: bool = True  # its gradient goes back in backward (a mask or token ids: no)


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage (or chunk, when interleaved): what runs there and what it sends on.

    `modules` are the layers the stage holds (the first stage also runs what comes before the
    layers, the last what comes after). `cost` is what the split balanced, as the plan's
    "stage split" note says: forward FLOPs of one whole microbatch (all data-parallel ranks
    together), or parameter bytes; the embedding, head and loss count on the end stages.
    `sends` are the values crossing to the next stage, per microbatch and per rank.
    """

    index: int
    rank: int  # pp coordinate that runs it
    modules: tuple[str, ...]
    cost: float = 0.0
    sends: tuple[Boundary, ...] = ()


_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16", "fp64": "float64", "float64": "float64"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Precision:
    """Dtypes of the parameters as computed with, of gradient reductions, and of the outputs.

    Master weights and optimizer state stay fp32 whatever `param` is.

    Example:
        >>> Precision.parse("bf16")
        Precision(param='bfloat16', reduce='float32', output='float32')
        >>> Precision.parse("param=bf16,reduce=bf16")
        Precision(param='bfloat16', reduce='bfloat16', output='float32')
    """

    param: str = "float32"
    reduce: str = "float32"
    output: str = "float32"

    def __post_init__(self):
        for field_name in ("param", "reduce", "output"):
            value = getattr(self, field_name)
            if value not in _DTYPES.values():
                raise ValueError(f"Precision {field_name}={value!r}: use one of {sorted(set(_DTYPES))}")

    @classmethod
    def parse(cls, text: str) -> Precision:
        """`"bf16"` (bf16 compute, fp32 reductions and outputs) or `"param=bf16,reduce=fp32,output=bf16"`."""
        text = text.strip().lower()
        if "=" not in text:
            if text not in _DTYPES:
                raise ValueError(
                    f"precision {text!r}: use one of {sorted(set(_DTYPES))} or param=..,reduce=..,output=.."
                )
            return cls(param=_DTYPES[text])
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in ("param", "reduce", "output") or value not in _DTYPES:
                raise ValueError(
                    f"precision {text!r}: {part!r} is not param|reduce|output=<{'|'.join(sorted(_DTYPES))}>"
                )
            fields[key] = _DTYPES[value]
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes per rank."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    peak: int = 0


@dataclass(frozen=True, slots=True)
class Kept:
    """What one layer keeps for its backward, per microbatch on one rank: the live bytes its forward
    adds and holds until its backward (its output included, which the next layer holds as its input),
    as the plan's recompute mode runs it. `items`: what the layer saves for backward without recompute,
    by value, largest first: `(value, bytes)`, the value named by the op that made it and the ops that
    keep it."""

    layer: str
    bytes: int
    items: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    mesh: Mesh
    specs: tuple[tuple[str, P], ...] = ()
    collectives: tuple[Collective, ...] = ()
    stages: tuple[Stage, ...] = ()
    schedule: str = ""
    microbatches: int = 1
    zero: int = 0
    precision: Precision = field(default_factory=Precision)
    recompute: str = "none"
    uneven: str = "error"
    memory: Memory | None = None
    notes: tuple[tuple[str, str], ...] = ()  # e.g. ("trace", "fx"), ("model", "llama-7b")
    # per tensor, its placement on each mesh axis as the backend lays it out, e.g.
    # ("h.0.attn.c_attn.weight", ("R", "S(0/3)")): "S(d/g)" splits dim d in g groups
    # first (a fused projection), and "S(d/2:1:1)" in unequal parts of those proportions
    # (grouped-query attention's q, k and v), which a P cannot say
    placements: tuple[tuple[str, tuple[str, ...]], ...] = ()
    pp_axis: str = ""  # the pipeline's mesh axis ("" without a pipeline)
    # with a pipeline, the memory of the ranks at each pp coordinate (`memory` is the most loaded's)
    stage_memory: tuple[Memory, ...] = ()
    kept: tuple[Kept, ...] = ()  # per layer, what it keeps for backward per microbatch (the dry run's)
    # per pp coordinate (one without a pipeline), what its ranks compute per microbatch (the dry run's count)
    compute: tuple[StageCompute, ...] = ()
    model_flops: float = 0.0  # the model's forward and backward FLOPs in a step, all ranks together (for MFU)
    tokens: int = 0  # tokens in a step's global batch
    prediction: Prediction | None = None  # the step on some devices (`meshlib.predict_plan`), once asked for

    def __post_init__(self):
        _set = object.__setattr__
        if isinstance(self.specs, Mapping):
            _set(self, "specs", tuple(self.specs.items()))
        if isinstance(self.notes, Mapping):
            _set(self, "notes", tuple(self.notes.items()))
        if isinstance(self.placements, Mapping):
            _set(self, "placements", tuple((k, tuple(v)) for k, v in self.placements.items()))
        for name in ("collectives", "stages", "kept", "compute"):
            _set(self, name, tuple(getattr(self, name)))
        for path, spec in self.specs:
            if not isinstance(spec, P):
                raise TypeError(f"Plan spec for {path!r} is {spec!r}, not a P")

    # -- views ----------------------------------------------------------------
    @property
    def spec_map(self) -> dict[str, P]:
        return dict(self.specs)

    @property
    def note_map(self) -> dict[str, str]:
        return dict(self.notes)

    def replace(self, **changes) -> Plan:
        return dataclasses.replace(self, **changes)

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        """The pp coordinates that run stages (`(0,)` without a pipeline)."""
        return tuple(sorted({s.rank for s in self.stages})) or (0,)

    def rank_collectives(self, pp_rank: int | None = None) -> list[Collective]:
        """The collectives a rank at pp coordinate `pp_rank` runs in a step (every one without a pipeline)."""
        if pp_rank is None or not self.stages:
            return list(self.collectives)
        return [c for c in self.collectives if c.pp_rank in (-1, pp_rank)]

    def rank_memory(self, pp_rank: int | None = None) -> Memory | None:
        """The memory of a rank at pp coordinate `pp_rank`; without one, the most loaded rank's."""
        if pp_rank is None or not self.stage_memory:
            return self.memory
        return self.stage_memory[pp_rank]

    def comm_bytes(
        self, *, kind: str | None = None, axes: tuple[str, ...] | None = None, bus: bool = False,
        pp_rank: int | None = None,
    ) -> float:  # fmt: skip
        """Bytes per rank per step (payload, or ring bus bytes), optionally for one kind or axis group.
        With a pipeline: of the ranks at `pp_rank`, or by default of the pp coordinate that moves most."""
        if pp_rank is None and self.stages:
            return max(self.comm_bytes(kind=kind, axes=axes, bus=bus, pp_rank=r) for r in self.pp_ranks)
        return sum(
            c.bus_bytes if bus else c.total_bytes
            for c in self.rank_collectives(pp_rank)
            if (kind is None or c.kind == kind) and (axes is None or c.axes == tuple(axes))
        )

    # -- JSON -------------------------------------------------------------------
    def to_json(self, **dumps) -> str:
        return json.dumps(_encode(self), **dumps)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return _decode(Plan, json.loads(text))

    # -- tables -----------------------------------------------------------------
    def tables(self) -> list[Table]:
        settings = [
            ("mesh", repr(self.mesh)),
            ("zero", self.zero),
            (
                "precision",
                f"param {self.precision.param}, reduce {self.precision.reduce}, output {self.precision.output}",
            ),
            ("recompute", self.recompute),
            ("uneven", self.uneven),
        ]
        if self.schedule:
            settings.append(("schedule", f"{self.schedule}, {self.microbatches} microbatches"))
        settings += list(self.notes)
        out = [Table("plan", ("setting", "value"), settings)]
        out.append(Table("layouts", ("tensor", "spec"), [(p, repr(s)) for p, s in self.specs]))
        if self.collectives:
            staged = bool(self.stages)
            rows = [
                (c.phase, c.kind, ",".join(c.axes), human_bytes(c.bytes), c.count, c.node, c.op, c.source, c.reason)
                + (("all" if c.pp_rank < 0 else c.pp_rank,) if staged else ())
                for c in self.collectives
            ]
            out.append(
                Table(
                    "collectives per step",
                    ("phase", "kind", "axes", "bytes/rank", "count", "node", "op", "source", "why")
                    + (("pp rank",) if staged else ()),
                    rows,
                    self.comm_caption(),
                )
            )
        if self.stages:
            rows = [
                (
                    s.index,
                    s.rank,
                    _span(s.modules),
                    f"{s.cost:.3g}",
                    "; ".join(f"{b.name} {b.shape} {human_bytes(b.bytes)}" for b in s.sends),
                )
                for s in self.stages
            ]
            out.append(Table("pipeline stages", ("stage", "pp rank", "modules", "cost", "sends per microbatch"), rows))
        if self.memory is not None:
            out.append(self.memory_table())
        out += self.kept_tables()
        if self.prediction is not None:
            out.append(self.prediction_table())
        return out

    def prediction_table(self) -> Table:
        """The predicted step: its time, throughput, MFU, and the shares of compute, exposed communication,
        the pipeline's bubble and the optimizer."""
        p = self.prediction
        rows = [("step time", f"{p.step_time:.4g} s"), ("tokens/s", f"{p.tokens_per_s:,.0f}"), ("MFU", f"{p.mfu:.1%}")]
        rows += [(f"{name} share", f"{share:.1%}") for name, share in p.shares.items()]
        rows += [("peak memory per rank", human_bytes(p.memory)), ("bytes moved per rank", human_bytes(p.comm_bytes))]
        caption = f"on {p.devices} {p.profile} devices (meshlib.predict: compute, alpha-beta links, overlap, bubble)"
        return Table("predicted step", ("what", "value"), rows, caption)

    def kept_tables(self) -> list[Table]:
        """What each layer keeps for backward per microbatch (runs of equal layers together), and what one
        layer saves without recompute, by value."""
        if not self.kept:
            return []
        runs: list[list[Kept]] = []
        for k in self.kept:
            if runs and runs[-1][-1].bytes == k.bytes:
                runs[-1].append(k)
            else:
                runs.append([k])
        rows = [(_span(tuple(k.layer for k in run)), human_bytes(run[0].bytes)) for run in runs]
        mode = "without recompute" if self.recompute == "none" else f"under {self.recompute} recompute"
        caption = f"{mode}: what a layer's forward adds and holds until its backward"
        out = [Table("kept for backward per layer, per microbatch", ("layers", "bytes"), rows, caption)]
        one = self.kept[1] if len(self.kept) > 1 else self.kept[0]  # past the first: the steady state
        if one.items:
            rows = [(what, human_bytes(n)) for what, n in one.items]
            total = human_bytes(sum(n for _, n in one.items))
            out.append(Table(f"what {one.layer} saves for backward without recompute", ("value (op)", "bytes"),
                             rows, f"{total} in all, per microbatch"))  # fmt: skip
        return out

    def comm_caption(self) -> str:
        """The bytes per rank per step, in words (per pp rank with a pipeline)."""
        if not self.stages:
            return f"total {human_bytes(self.comm_bytes())} per rank per step"
        each = ", ".join(f"{r}: {human_bytes(self.comm_bytes(pp_rank=r))}" for r in self.pp_ranks)
        return f"per rank per step, by pp rank ({each}); a stage runs its collectives once per microbatch"

    def memory_table(self) -> Table:
        """Bytes per rank: the most loaded rank's, and with a pipeline every pp rank's."""
        masters = self.precision.param in ("bfloat16", "float16") and self.zero < 2
        names = {
            "params": "parameters", "grads": "gradients",
            "optimizer": "optimizer state (moments, fp32 masters)" if masters else "optimizer state (moments)",
            "activations": "step: activations, gradients, temporaries", "peak": "peak (dry run)",
        }  # fmt: skip
        shown = [k for k in names if k in ("params", "grads", "optimizer") or getattr(self.memory, k)]
        mems = [self.memory] + list(self.stage_memory)
        heads = ["most loaded rank"] + [f"pp rank {r}" for r in range(len(self.stage_memory))]
        rows = [(names[k], *(human_bytes(getattr(m, k)) for m in mems)) for k in shown]
        where = "full-precision shards (FSDP2)" if self.zero >= 2 else f"{self.precision.param} parameters"
        caption = f"ZeRO-{self.zero}: {where}; model state as stored between steps"
        return Table("memory per rank", ("what", *heads) if self.stage_memory else ("what", "bytes"), rows, caption)

    def __str__(self) -> str:
        return "\n\n".join(t.to_text() for t in self.tables())

    def __rich__(self):
        from rich.console import Group

        return Group(*(t.__rich__() for t in self.tables()))

    def _repr_html_(self) -> str:
        return "".join(t._repr_html_() for t in self.tables())

    def diff(self, other: Plan) -> str:
        """What changes from this plan to `other`, one line each ('' when equal)."""
        return plan_diff(self, other)


def _span(modules: tuple[str, ...]) -> str:
    return modules[0] if len(modules) == 1 else f"{modules[0]} .. {modules[-1]} ({len(modules)})" if modules else ""


def plan_diff(a: Plan, b: Plan) -> str:
    lines = []
    for f in dataclasses.fields(Plan):
        if f.name in ("specs", "collectives"):
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.name == "notes":
            va, vb = dict(va), dict(vb)
        if va != vb:
            lines.append(f"~ {f.name}: {va!r} -> {vb!r}")
    sa, sb = a.spec_map, b.spec_map
    for path in sa.keys() | sb.keys():
        if path not in sb:
            lines.append(f"- spec {path}: {sa[path]!r}")
        elif path not in sa:
            lines.append(f"+ spec {path}: {sb[path]!r}")
        elif sa[path] != sb[path]:
            lines.append(f"~ spec {path}: {sa[path]!r} -> {sb[path]!r}")
    ca, cb = _comm_summary(a), _comm_summary(b)
    for key in sorted(ca.keys() | cb.keys()):
        (na, ba), (nb, bb) = ca.get(key, (0, 0)), cb.get(key, (0, 0))
        if (na, ba) != (nb, bb):
            phase, kind, axes = key
            lines.append(
                f"~ {phase} {kind} over {axes or '-'}: {na} x -> {nb} x, "
                f"{human_bytes(ba)} -> {human_bytes(bb)} per rank per step"
            )
    return "\n".join(sorted(lines, key=lambda s: s[2:]))


def _comm_summary(plan: Plan) -> dict:
    out: dict = {}
    for c in plan.collectives:
        key = (c.phase, c.kind, ",".join(c.axes))
        n, b = out.get(key, (0, 0))
        out[key] = (n + c.count, b + c.total_bytes)
    return out


# -- a small typed JSON codec for the records above ---------------------------------
def _encode(value):
    if isinstance(value, (Mesh, P)):
        return value.to_json()
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode(tp, data):
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [t for t in typing.get_args(tp) if t is not type(None)]
        return _decode(inner[0], data)
    if tp in (Mesh, P):
        return tp.from_json(data)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{k: _decode(hints[k], v) for k, v in data.items()})
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in data)
        return tuple(_decode(t, v) for t, v in zip(args, data))
    return data
