"""What the compiler hands the runtime: a `Compiled` program, and the model state it implies per rank.

A `Compiled` holds the program in one of its three shapes (`OneGraph`;
`TracedStages`, a pipeline cut from the traced graph; `EagerStages`, one cut
from the eager model when no tracer could follow it), every parameter's and
input's layout, the inserted collectives and rank-dependent ops, and the core's
`Plan`. It is frozen: each compiler step that adds to it returns a new one. The
runtime carries it out and decides nothing the plan does not say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshlib import Memory, Mesh, NamedSharding, P, Plan
from meshlib.cost import fsdp2_memory, zero_memory
from meshlib.options import Parallelism

from ..modules.recompute import Remat
from .capture.attention import CP_AXIS, cp_size, zigzag_input
from .capture.trace import Traced
from .placement.annotate import check_single_axis_uneven, spec_to_layout
from .placement.placements import Layout, Shard, sync_axes, zero1_split, zigzag
from .placement.propagate import Axes, NodePlan
from .placement.rank_ops import SpecialSpec
from .placement.redistribute import CommSpec
from .placement.shapes import local_shape, ragged_dims, rank_order, shard_indices


@dataclass(frozen=True)
class OneGraph:
    """No pipeline: one graph, run once per microbatch (several accumulate their gradients)."""

    graph: fx.Graph


@dataclass(frozen=True)
class TracedStages:
    """A pipeline cut from the traced graph of one microbatch (`graph`): a graph per stage (`StageGraphs`)
    and the core schedule that runs them."""

    graph: fx.Graph
    stages: object
    schedule: object


@dataclass(frozen=True)
class EagerStages:
    """A pipeline cut from the eager model by module FQN (no tracer could follow it): its stages
    (`fqn_split.EagerStages`) and the core schedule."""

    stages: object
    schedule: object


Program = OneGraph | TracedStages | EagerStages


@dataclass(frozen=True)
class Compiled:
    """The program (`OneGraph`, `TracedStages` or `EagerStages`), every parameter's and input's layout, the
    collectives and rank-dependent ops, the plan; frozen: a step that adds to it makes a new one."""

    mesh: Mesh
    axes: Axes
    program: Program
    traced: Traced
    comms: list[CommSpec]
    specials: list[SpecialSpec]
    param_specs: dict[str, P]
    param_layouts: dict[str, Layout]
    input_layouts: dict[str, Layout]
    input_names: list[str]
    plan: Plan
    options: Parallelism
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    plans: dict[fx.Node, NodePlan] = field(default_factory=dict, repr=False)
    data_axes: tuple[str, ...] = ()
    parts: dict[fx.Node, int] = field(default_factory=dict, repr=False)  # node -> pre/layer/post part
    synced_params: frozenset[str] = frozenset()  # gradients the runtime sums over the data axes
    routers: tuple[tuple[str, str, float], ...] = ()  # token counts, balancing biases (`capture.moe.balancing_routers`)
    full_buffers: frozenset[str] = frozenset()  # floating buffers kept in their own dtype (`capture.moe.full_buffers`)
    persistent: frozenset[str] = frozenset()  # buffers in the model's state dict (checkpoints keep them)
    microbatches: int = 1  # in the global batch: a pipeline's, or (one graph) gradient accumulation's
    pp_axis: str = "pp"
    layers: int = 0  # the model's layers (its longest ModuleList): blocks for FSDP2 and recompute
    layer_paths: tuple[str, ...] = ()  # their FQNs
    remat: Remat = field(default_factory=Remat)  # collectives recompute runs again, all-gathers backward repeats

    @property
    def graph(self) -> fx.Graph:
        """The traced graph of one microbatch (a traced program's: not an eager-split pipeline's)."""
        if isinstance(self.program, EagerStages):
            raise TypeError("a pipeline cut from the eager model by module FQN has no traced graph")
        return self.program.graph

    @property
    def pipelined(self) -> bool:
        return isinstance(self.program, (TracedStages, EagerStages))

    @property
    def stages(self):
        """A pipeline's stages (`StageGraphs` or `fqn_split.EagerStages`)."""
        if not self.pipelined:
            raise TypeError("a program without a pipeline has no stages")
        return self.program.stages

    @property
    def schedule(self):
        """A pipeline's core schedule."""
        if not self.pipelined:
            raise TypeError("a program without a pipeline has no schedule")
        return self.program.schedule

    def rank_indices(self, name: str, rank: int) -> list:
        """Per dim, the global indices of parameter `name` that `rank` holds."""
        coords = self.mesh.coords(rank)
        return shard_indices(
            tuple(self.traced.params[name].shape),
            self.param_layouts[name],
            self.axes.sizes,
            [coords[a] for a in self.axes.names],
        )

    def param_rank_order(self, name: str) -> dict[int, torch.Tensor]:
        """Per dim of parameter `name` split in unequal parts: the model's row of each of the DTensor's
        rows, which hold them in rank order (`shapes.rank_order`); empty for every other parameter."""
        return rank_order(tuple(self.traced.params[name].shape), self.param_layouts[name], self.axes.sizes)

    def local_param_shape(self, name: str) -> tuple[int, ...]:
        """The parameter's shard on the first rank (the largest, where a dim is cut unevenly)."""
        return local_shape(tuple(self.traced.params[name].shape), self.param_layouts[name], self.axes.sizes)


def persistent_buffers(model: torch.nn.Module) -> frozenset[str]:
    """The buffers a model's state dict holds (not those registered with persistent=False)."""
    keys = set(model.state_dict(keep_vars=True))
    return frozenset(n for n, _ in model.named_buffers() if n in keys)


def default_in_spec(
    mesh: Mesh, replicate_axes: tuple[str, ...] = (), *, shape: tuple[int, ...] = (), seq_len: int | None = None
) -> P:
    """Inputs are split on their batch dim over the data-parallel axes: `dp`, `ep` (expert parallelism borrows
    data ranks, as torchtitan's dp2ep), and HSDP's replicate axes. With `cp` (context parallelism) in the mesh,
    an input of `shape` whose dim 1 is the sequence (`seq_len`: token ids, labels, position ids) has that dim
    split over `cp` too."""
    data = tuple(a for a in mesh.axis_names if (a in ("dp", "ep") or a in replicate_axes) and mesh.axis_size(a) > 1)
    if cp_size(mesh) > 1 and seq_len is not None and len(shape) >= 2 and shape[1] == seq_len:
        return P(data or None, CP_AXIS)
    return P(data) if data else P()


def sequence_length(tensors: dict[str, torch.Tensor]) -> int | None:
    """The sequence's length: dim 1 of the first input with two dims or more (the token ids), or None."""
    return next((int(x.shape[1]) for x in tensors.values() if x.dim() >= 2), None)


def data_axes(in_layouts: dict[str, Layout], mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes that split the batch dim of every input (in mesh order), and `cp` where it splits the
    sequence dim (1) of every input: outside attention it is a data axis (gradients summed over it)."""
    layouts = list(in_layouts.values())

    def splits(i: int, a: str) -> bool:
        want = (Shard(1), zigzag(1)) if a == CP_AXIS else (Shard(0),)
        return all(lay[i] in want for lay in layouts)

    return tuple(
        a for i, a in enumerate(mesh.axis_names) if layouts and mesh.axis_size(a) > 1 and splits(i, a)
    )  # fmt: skip


def check_zero(zero: int, data: tuple[str, ...], mesh: Mesh) -> None:
    """ZeRO shards over the data-parallel axes: refuse it on a plan that has none."""
    if zero >= 1 and not data:
        axes = ", ".join(f"{a}={mesh.axis_size(a)}" for a in mesh.axis_names)
        raise ValueError(
            f"zero={zero} shards the model state over the data-parallel axes, but this plan has none "
            f"(mesh {axes}; no axis splits the batch of every input). Fix: add a data axis (dp=N), "
            "or use zero=0"
        )


def input_layouts(
    tensors: dict[str, torch.Tensor], in_specs, mesh: Mesh, replicate_axes=(), uneven: str = "error",
    cp_layout: str = "zigzag",
) -> dict[str, Layout]:
    """Each input's layout: its spec from `in_specs` (by name, or in order), else the batch split over dp.
    Under `cp_layout="zigzag"` an input's sequence dim (1) split over `cp` holds each rank's head-tail chunks
    (`placement.placements.zigzag`): the same values as `P(..., "cp")` gives, in another order over the ranks."""
    names = list(tensors)
    if in_specs is None:
        seq = sequence_length(tensors)
        in_specs = {n: default_in_spec(mesh, replicate_axes, shape=tuple(x.shape), seq_len=seq)
                    for n, x in tensors.items()}  # fmt: skip
    elif not isinstance(in_specs, dict):
        in_specs = dict(zip(names, in_specs))
    unknown = sorted(set(in_specs) - set(names))
    if unknown:
        raise ValueError(f"in_specs names {unknown}, which are not tensor inputs of the call ({names})")
    out = {}
    for name, x in tensors.items():
        spec = in_specs.get(name, P())
        # first: cp's fix
        layout = zigzag_input(spec_to_layout(spec, mesh), mesh, tuple(x.shape), name, cp_layout, uneven)
        NamedSharding(mesh, spec, uneven=uneven).check(tuple(x.shape), path=f"input {name!r}")
        check_single_axis_uneven(mesh, spec, tuple(x.shape), uneven, f"input {name!r}")
        out[name] = layout
    return out


def buffer_dtype(compiled: Compiled, name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype buffer `name` (holding `t`) runs in: a floating one in the compute dtype, unless the model keeps
    it in full precision (`Compiled.full_buffers`: a router's token counts and balancing bias)."""
    if not t.is_floating_point() or name in compiled.full_buffers:
        return t.dtype
    return getattr(torch, compiled.options.precision.param)


def shard_axes(compiled: Compiled, name: str) -> tuple[str, ...]:
    """The data axes ZeRO shards parameter `name`'s state over: those its gradient is summed over
    (`sync_axes`: all of them, but `ep` for an expert weight split over it), less HSDP's replicate axes."""
    summed = sync_axes(compiled.param_layouts[name], compiled.axes.names, compiled.data_axes)
    return tuple(a for a in summed if a not in compiled.options.replicate_axes)


def shard_ranks(compiled: Compiled, name: str) -> int:
    """How many ranks ZeRO shards parameter `name`'s state over (the size of its `shard_axes`)."""
    return math.prod(compiled.mesh.axis_size(a) for a in shard_axes(compiled, name))


def model_state(compiled: Compiled, names=None) -> Memory:
    """Bytes per rank of parameters, gradients and optimizer state, as the runtime stores them, for
    the parameters in `names` (by default all; with a pipeline, those a pp rank's stages hold).

    ZeRO-0/1 keep the ZeRO paper's layout (`meshlib.cost.zero_memory`): parameters and gradients in the compute
    dtype, fp32 masters (mixed precision) and two moments in the optimizer,
    sharded over the data axes from ZeRO-1. ZeRO-2/3 are FSDP2's storage:
    full-precision shards of parameters and gradients, and the moments; what
    FSDP2 leaves whole (`fsdp_whole`) is stored as under ZeRO-0. A shard is
    the largest rank's (torch.chunk's first).
    """
    opts = compiled.options
    full = next(iter(compiled.traced.params.values())).dtype
    mixed = getattr(torch, opts.precision.param) in (torch.bfloat16, torch.float16)
    names = [n for n in compiled.traced.params if names is None or n in names]
    numel = lambda name: math.prod(compiled.local_param_shape(name))  # noqa: E731
    if opts.zero >= 2:
        whole = fsdp_whole(compiled)
        shards = sum(_fsdp_shard(compiled, name, shard_ranks(compiled, name)) for name in names if name not in whole)
        kept = sum(numel(name) for name in names if name in whole)
        a = fsdp2_memory(shards, 1, itemsize=full.itemsize)
        b = zero_memory(kept, 1, zero=0, mixed=mixed, itemsize=full.itemsize)
        return Memory(params=int(a.params + b.params), grads=int(a.grads + b.grads),
                      optimizer=int(a.optimizer + b.optimizer))  # fmt: skip
    psi = sum(numel(name) for name in names)
    pieces = {k: v for k, v in zero1_pieces(compiled).items() if k in names}
    if opts.zero != 1 or not pieces:
        state = zero_memory(psi, 1, zero=0, mixed=mixed, itemsize=full.itemsize)
        return Memory(params=int(state.params), grads=int(state.grads), optimizer=int(state.optimizer))
    state = zero_memory(psi, 1, zero=1, mixed=mixed, itemsize=full.itemsize)
    per = zero_memory(1, 1, zero=1, mixed=mixed, itemsize=full.itemsize).optimizer  # bytes per element
    whole = sum(numel(name) for name in names if pieces.get(name) is None)
    kept = sum(k for k in pieces.values() if k is not None)
    # a piece holds its share of the moments (and of the fp32 master, if separate); a whole tensor
    # holds all of them, and always a full-precision master copy of its own
    return Memory(
        params=int(state.params),
        grads=int(state.grads),
        optimizer=round(per * kept + 3 * full.itemsize * whole),
    )


def fsdp_whole(compiled: Compiled) -> set[str]:
    """The parameters FSDP2 leaves whole under ZeRO-2/3: 1-D ones split in groups over tensor
    parallelism (a fused projection's bias: FSDP cannot nest its shard in that layout), and those
    two pipeline stages hold (a tied embedding and head: each stage would shard its own), and those no
    data axis it is replicated on remains for (an expert weight on a mesh whose only data axis is ep)."""
    out = {
        name for name, layout in compiled.param_layouts.items()
        if len(compiled.traced.params[name].shape) == 1 and any(getattr(p, "groups", 1) > 1 for p in layout)
    }  # fmt: skip
    if compiled.data_axes:
        out |= {name for name in compiled.param_layouts if not shard_axes(compiled, name)}
    stages = compiled.stages if compiled.pipelined else None
    if stages is not None and stages.params:
        count: dict[str, int] = {}
        for held in stages.params:
            for name in held:
                count[name] = count.get(name, 0) + 1
        out |= {name for name, k in count.items() if k > 1}
    return out


def _fsdp_shard(compiled: Compiled, name: str, n: int) -> int:
    """Elements of the largest FSDP2 shard of `name` over `n` ranks: dim 0 cut as torch.chunk does
    (dim 1 where tensor parallelism already splits dim 0 in groups)."""
    local = compiled.local_param_shape(name)
    if not local:
        return 1
    grouped = any(getattr(p, "groups", 1) > 1 and p.dim == 0 for p in compiled.param_layouts[name])
    dim = 1 if grouped and len(local) > 1 else 0
    return math.ceil(local[dim] / n) * math.prod(local) // max(1, local[dim])


def deferred_loss(compiled: Compiled):
    """The collective that sums the graph's scalar loss over one data axis for its output, when there
    is no pipeline (a pipeline's last stage keeps it): `(spec, axis)`, or None. The runtime runs it
    itself, beside backward, on the loss in the output dtype."""
    if not isinstance(compiled.program, OneGraph):
        return None
    out = next(n for n in compiled.graph.nodes if n.op == "output")
    for spec in compiled.comms:
        steps = spec.steps(compiled.axes, "forward")
        if spec.consumer == out.name and spec.shape == () and len(steps) == 1:
            kind, axis, _, _ = steps[0]
            if kind == "all_reduce" and axis in compiled.data_axes:
                return spec, axis
    return None


def zero1_pieces(compiled: Compiled) -> dict[str, int | None]:
    """Under ZeRO-1, the elements of each parameter's largest piece (rank 0's), or None where
    every rank keeps it whole (`placements.zero1_split`), over its `shard_ranks` (an expert weight's
    over the data ranks besides ep). Empty unless zero=1 over >1 ranks."""
    if compiled.options.zero != 1 or not compiled.data_axes:
        return {}
    out = {}
    for name in compiled.traced.params:
        split = zero1_split(*zero1_args(compiled, name))
        out[name] = None if split is None else split[0]
    return out


def zero1_in_backward(compiled: Compiled) -> bool:
    """Whether ZeRO-1's reduce-scatters run behind backward (`zero1_buckets.Zero1Buckets.watch`: the
    backward of the last microbatch, gradient sync on), not in the optimizer step: without a pipeline,
    whose schedule runs every microbatch's backward with the sync off."""
    return compiled.options.zero == 1 and bool(compiled.data_axes) and not compiled.pipelined


def zero1_args(compiled: Compiled, name: str) -> tuple:
    """What ZeRO-1's cut of parameter `name` is decided by (`placements.zero1_split`, `zero1_shard_dim`): its
    local shape, its `shard_ranks`, its layout, the dims another axis cuts unevenly and the number of data
    axes it is split over."""
    layout = compiled.param_layouts[name]
    ragged = ragged_dims(tuple(compiled.traced.params[name].shape), layout, compiled.axes.sizes)
    return (tuple(compiled.local_param_shape(name)), shard_ranks(compiled, name), layout, ragged,
            len(shard_axes(compiled, name)))  # fmt: skip


__all__ = [
    "Compiled", "EagerStages", "OneGraph", "Program", "TracedStages", "buffer_dtype", "check_zero", "data_axes",
    "default_in_spec", "deferred_loss", "fsdp_whole", "input_layouts", "model_state", "persistent_buffers",
    "sequence_length", "shard_axes", "shard_ranks", "zero1_args", "zero1_in_backward", "zero1_pieces",
]  # fmt: skip
