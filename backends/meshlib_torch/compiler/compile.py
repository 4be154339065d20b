"""The compiler's entry for any mesh: `compile_model`, the whole plan with nothing run.

With a pipeline axis the program is one microbatch's graph cut into stages
with the schedule that runs them (`pipeline.py`); else it is one graph
(`graph.py`), of one microbatch when the step accumulates gradients over
several. Either way the result is one `Compiled` that the runtime carries out.
"""

from __future__ import annotations

import difflib
import math

import torch

from meshlib import CANONICAL_AXES, Mesh, P, Precision
from meshlib.cost import zero_level
from meshlib.sharding import UNEVEN_POLICIES

from .capture.call import Call, LossSpec, bind_call
from .estimates.records import step_collectives
from .graph import compile_graph
from .pipeline.compile import compile_pipeline
from .placement.placements import Shard
from .placement.shapes import ragged_dims
from .program import Compiled, Options, check_recompute, input_layouts


def compile_model(
    model: torch.nn.Module,
    /,
    *,
    mesh: Mesh,
    rules,
    example_inputs: tuple | dict | Call = (),
    example_kwargs: dict | None = None,
    loss: LossSpec = None,
    in_specs: dict[str, P] | tuple[P, ...] | None = None,
    sequence_parallel: bool = False,
    tp_axis: str = "tp",
    seq_dim: int = 1,
    zero: int | str = 0,
    precision: Precision | str | None = None,
    recompute: str = "none",
    replicate_axes: tuple[str, ...] = (),
    microbatches: int = 1,
    schedule: str = "1f1b",
    chunks: int | None = None,
    pp_axis: str = "pp",
    split_points: list[int] | None = None,
    balance: str = "flops",
    estimate_memory: bool = False,
    allow_data_gather: bool = False,
    idle_axes: tuple[str, ...] = (),
    uneven: str = "error",
) -> Compiled:
    """Compile `model` for `mesh`: no processes, no real memory (the model may be on meta).

    The model is called as `model(*example_inputs, **example_kwargs)` on the global batch
    (`example_inputs` may also be a dict of keyword inputs); its tensors are the compiled
    model's inputs, by name, and its other values are fixed. The compiled model returns the
    loss: the output itself, a dict's or `ModelOutput`'s `"loss"`, or what `loss=` picks (an
    index, key, attribute name or function of the output; see `compiler.call`).

    The data-parallel axes are those the inputs' batch dim is split over. Gradients are summed
    over them once per step by the runtime, by `zero` level: 0 all-reduces them, 1
    reduce-scatters them into a sharded optimizer, 2 and 3 hand the axes to FSDP2
    (`replicate_axes` makes that HSDP). `precision` is a `Precision` or its text (`"bf16"`,
    `"param=bf16,reduce=fp32"`). The batch holds `microbatches` microbatches: a pipeline's
    (a `pp_axis` in the mesh: `schedule`, `chunks` stages per rank, `split_points` or a
    `balance` by "flops" or "params"), else gradient accumulation's. Gathering an activation
    over a data axis is an error unless `allow_data_gather`. A mesh axis nothing is split over (no
    parameter, no input, not the pipeline's) is an error unless named in `idle_axes`: every rank
    along it would repeat the same work. `estimate_memory` adds the dry
    run's peak to the plan. `uneven="chunk"` lets a dim that does not divide over its axis be cut in
    torch.chunk's sizes (DTensor's Shard), as `NamedSharding(..., uneven="chunk")` lays it out: the
    first ranks hold one more row, and collectives over it move it padded to equal pieces.
    """
    options = Options(
        zero_level(zero), _precision(model, precision), check_recompute(recompute), tuple(replicate_axes),
        allow_data_gather, _uneven(uneven),
    )  # fmt: skip
    call = example_inputs
    if not isinstance(call, Call):
        call = bind_call(model, example_inputs, example_kwargs, loss=loss)
    _check_microbatches(call, microbatches)
    if microbatches > 1 and uneven != "error":
        layouts = input_layouts(call.tensors, in_specs, mesh, options.replicate_axes, uneven)
        _check_ragged_batch(layouts, mesh, call, microbatches)
    common = dict(mesh=mesh, rules=rules, options=options, in_specs=in_specs, sequence_parallel=sequence_parallel)
    if pp_axis in mesh and mesh.axis_size(pp_axis) > 1:
        compiled = compile_pipeline(
            model, call, **common, microbatches=microbatches, schedule=schedule, chunks=chunks, pp_axis=pp_axis,
            split_points=split_points, balance=balance, estimate_memory=estimate_memory,
        )  # fmt: skip
        _check_axes_used(compiled, pp_axis, idle_axes)
        return compiled
    compiled = compile_graph(
        model, call.micro(microbatches), **common, tp_axis=tp_axis, seq_dim=seq_dim, estimate_memory=estimate_memory
    )
    compiled.microbatches = microbatches
    compiled.plan = compiled.plan.replace(
        collectives=tuple(step_collectives(compiled, microbatches)), microbatches=microbatches
    )
    _check_axes_used(compiled, pp_axis, idle_axes)
    return compiled


def _check_ragged_batch(layouts: dict, mesh: Mesh, call: Call, microbatches: int) -> None:
    """A batch cut unevenly over the data axes cannot also be cut into microbatches: each rank's
    microbatch would not be the piece of the global microbatch the graph was compiled for."""
    for name, x in call.tensors.items():
        layout = layouts.get(name)
        micro = (x.shape[0] // microbatches, *x.shape[1:])
        if layout is not None and x.dim() and 0 in ragged_dims(micro, layout, mesh.axis_sizes):
            ways = math.prod(n for p, n in zip(layout, mesh.axis_sizes) if p == Shard(0))
            raise ValueError(
                f"input {name!r}: its microbatch of {micro[0]} does not divide over the {ways} data-parallel "
                f"ranks, and uneven='chunk' does not cut a batch that is also cut into {microbatches} "
                f"microbatches. Fix: make the batch a multiple of {microbatches * ways}, or use microbatches=1"
            )


def _check_axes_used(compiled: Compiled, pp_axis: str, idle_axes: tuple[str, ...]) -> None:
    """Refuse a mesh axis (of size > 1) that nothing is split over: not a data axis, no parameter's or
    input's layout shards over it, and it is not the pipeline's. Most often a typo (`tq` for `tp`)."""
    mesh = compiled.mesh
    used = set(compiled.data_axes) | ({pp_axis} if pp_axis in mesh else set())
    for layout in [*compiled.param_layouts.values(), *compiled.input_layouts.values()]:
        used |= {a for a, p in zip(mesh.axis_names, layout) if isinstance(p, Shard)}
    idle = [a for a in mesh.axis_names if mesh.axis_size(a) > 1 and a not in used and a not in idle_axes]
    if not idle:
        return
    hints = []
    for axis in idle:
        near = difflib.get_close_matches(axis, [a for a in CANONICAL_AXES if a not in mesh], n=1, cutoff=0.3)
        hints.append(f"{axis!r} (did you mean {near[0]!r}?)" if near else repr(axis))
    used_text = ", ".join(a for a in mesh.axis_names if a in used) or "none"
    raise ValueError(
        f"mesh axis {', '.join(hints)} splits nothing: no parameter or input is sharded over it, it is not a "
        f"data-parallel or pipeline axis, so every rank along it would repeat the same work. Axes in use: "
        f"{used_text}. Fix: rename the axis, write rules that shard over it, or pass idle_axes={tuple(idle)!r} "
        f"(--idle-axes {','.join(idle)}) if pure replication is what you want"
    )


def _uneven(value: str) -> str:
    if value not in UNEVEN_POLICIES:
        raise ValueError(f"uneven={value!r}: choose one of {UNEVEN_POLICIES}")
    return value


def _precision(model: torch.nn.Module, precision) -> Precision:
    if isinstance(precision, str):
        return Precision.parse(precision)
    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(
            f"precision={precision!r}: pass a meshlib.Precision, or text such as 'bf16' or 'param=bf16,reduce=fp32'"
        )
    own = str(next(model.parameters()).dtype).removeprefix("torch.")
    return precision or Precision(own, own, own)  # compute, reduce and output in the model's own dtype


def _check_microbatches(call: Call, microbatches: int) -> None:
    """Every tensor input splits along dim 0 into `microbatches` equal parts."""
    batches = {n: x.shape[0] if x.dim() else None for n, x in call.tensors.items()}
    batch = next(iter(batches.values()))
    if microbatches != 1 and any(b != batch for b in batches.values()):
        raise ValueError(
            f"the inputs' batch sizes differ ({batches}); microbatches split every input along dim 0. "
            "Fix: give every tensor input the batch as its first dim"
        )
    splits = isinstance(microbatches, int) and microbatches >= 1
    if not splits or (microbatches > 1 and (batch is None or batch % microbatches)):
        raise ValueError(
            f"the batch of {batch} does not split into {microbatches} microbatches. Fix: make the batch a "
            f"multiple of the microbatch count, or pick a count that divides {batch}"
        )


__all__ = ["compile_model"]
