"""Pipeline parallelism: the compiled model's stages on the pp axis, run by torch.distributed.pipelining.

Each pp rank builds only its stages (its parameters alone are materialized)
as `PipelineStage`s over the pp process group, whose timeout bounds every
send and receive. GPipe, 1F1B, interleaved 1F1B and ZBV are torch's own
schedule classes; ZB-H1 (one stage per rank, backward split into input and
weight gradients) runs the core's `zb_h1` action lists on torch's schedule
runtime, which lowers them to sends and receives. The loss is computed on the
last stage and every rank gets the step's mean; gradients are summed over
the data-parallel axes once all microbatches are in, and a parameter two
stages share (tied embeddings) has its gradient summed between them.

A model that neither fx nor torch.export can trace is cut by module FQN on
the eager model instead (`compiler.fqn_split`, built by `eager_stages`); the
same schedules, gradient sync and `Pipelined` run it, and the plan says so.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining import schedules as _torch_schedules

from meshlib import schedule as core_schedule

from ..compiler.call import batch_call
from ..compiler.fqn_split import EagerStages
from ..compiler.shapes import local_shape
from ..compiler.stages import value_layout
from .comm import COUNTER

_TORCH = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}


def _loss(output, target):
    """The last stage already returns the microbatch's loss."""
    return output[0] if isinstance(output, (tuple, list)) else output


class Pipelined(nn.Module):
    """This pp rank's stages of a compiled model, and the schedule that runs them.

    `stage_graphs` is a `StageGraphs` or an `EagerStages` (only its `params` are read here).
    `grad_divisor`: when the schedule leaves the gradients summed over the microbatches
    (`make_schedule(..., scale_grads=False)`), each parameter's is divided once by it here.
    """

    def __init__(
        self, par, stage_graphs, local: list[int], modules: list[nn.Module], sched, core, pp_group, microbatches
    ):
        super().__init__()
        self.par, self.stage_graphs, self.local, self.core = par, stage_graphs, local, core
        self.stage_modules = nn.ModuleList(modules)
        self.schedule, self.pp_group, self.microbatches = sched, pp_group, microbatches
        self.tied_groups: list[tuple[set[str], object]] = []
        self.grad_divisor = 1
        n = len(stage_graphs.params)
        self.first, self.last = 0 in local, (n - 1) in local
        self.last_rank = dist.get_global_rank(pp_group, core.placement[n - 1])

    @property
    def plan(self):
        return self.par.plan

    @property
    def compiled(self):
        return self.par.compiled

    def named_model_parameters(self) -> dict[str, nn.Parameter]:
        return self.par.named_model_parameters()

    def optimizer(self, **kwargs):
        """AdamW over this rank's stages' parameters (see `Parallel.optimizer`)."""
        return self.par.optimizer(**kwargs)

    def grad_norm(self) -> float:
        """The global gradient norm: over data and tensor axes by DTensor, over stages by an all-reduce
        (a parameter two stages share counts once)."""
        first = {}
        for s in sorted(self.local):
            for name in self.stage_graphs.params[s]:
                first.setdefault(name, s)
        owners = {}
        for s, names in enumerate(self.stage_graphs.params):
            for name in names:
                owners.setdefault(name, s)
        total = torch.zeros((), dtype=torch.float64)
        data = self.compiled.data_axes if self.par.zero == 1 else ()  # ZeRO-1 sums them only in its step
        group = None
        if data:
            from . import dist as mdist

            group = mdist.group(self.par.device_mesh, data)
        for name, p in self.named_model_parameters().items():
            if p.grad is None or owners.get(name) not in self.local:
                continue
            g = p.grad.to(torch.float64)
            if group is not None:
                local = g._local_tensor.clone()
                dist.all_reduce(local, group=group)
                g = type(g).from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
            norm = torch.linalg.vector_norm(g)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            total += norm**2
        dist.all_reduce(total, group=self.pp_group)
        return float(total.sqrt())

    def train_step(self, microbatches_or_batch, opt) -> float:
        """One step over the global batch (the same on every rank); returns the mean loss everywhere."""
        args, kwargs = batch_call(microbatches_or_batch)
        local = self.par.local_inputs(args, kwargs)
        losses: list[torch.Tensor] = []
        if self.par.grad_sync is not None:
            self.par.grad_sync.enabled = False
        if self.first:
            target = torch.zeros(local[0].shape[0]) if self.last else None
            self._step(*local, target=target, losses=losses if self.last else None)
        elif self.last:
            self._step(target=torch.zeros(local[0].shape[0]), losses=losses)
        else:
            self._step()
        if self.grad_divisor != 1:  # once per parameter, however many local stages hold it
            for p in self.named_model_parameters().values():
                if p.grad is not None:
                    p.grad.div_(self.grad_divisor)
        self.sync_gradients()
        self.last_grad_norm = self.grad_norm()
        value = (
            torch.stack([x.detach().to(torch.float64) for x in losses]).mean()
            if losses
            else torch.zeros((), dtype=torch.float64)
        )
        dist.broadcast(value, src=self.last_rank, group=self.pp_group)
        COUNTER.record("step", "broadcast", "pp", 8, "loss")
        opt.step()
        opt.zero_grad()
        return float(value)

    def _step(self, *args, **kwargs) -> None:
        """Run the torch schedule; a send or receive past the group's timeout raises TimeoutError."""
        try:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            raise TimeoutError(
                f"pipeline step timed out on rank {dist.get_rank()} (stages {sorted(self.local)}, schedule "
                f"{self.core.name}) waiting for a send or receive between pp ranks: {err}. A peer rank died, "
                "skipped the step or is far slower. Fix: check the other ranks' errors; if the stages are "
                "just slow, raise `timeout=` (seconds) in parallelize"
            ) from err

    def sync_gradients(self) -> None:
        """Sum the data-parallel partial gradients once, and tied parameters' between their stages."""
        if self.par.grad_sync is not None:
            self.par.grad_sync.enabled = True
            self.par.grad_sync.flush()
        params = self.named_model_parameters()
        for names, group in self.tied_groups:
            for name in sorted(names):
                p = params.get(name)
                if p is None or p.grad is None:
                    continue
                g = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                dist.all_reduce(g, group=group)
                COUNTER.record("backward", "all_reduce", "pp", g.numel() * g.element_size(), f"tied {name}")


def placement(name: str, p: int, v: int) -> tuple[int, ...]:
    """Stage -> pp rank: round-robin (`s % p`), or V-shaped for zbv."""
    return core_schedule(name, p, max(p, 2 * p), v if name != "zbv" else None).placement


def build(
    par, stage_graphs, root: nn.Module, *, schedule_name: str, microbatches: int, v: int, pp_axis: str, dm, device
):
    """The PipelineStages of this rank and the schedule (call on every rank)."""
    from . import dist as mdist

    compiled = par.compiled
    p = compiled.mesh.axis_size(pp_axis)
    core = core_schedule(schedule_name, p, microbatches, v if schedule_name in ("interleaved-1f1b", "zb-h1") else None)
    pp_rank = compiled.mesh.coords(dist.get_rank())[pp_axis]
    group = mdist.group(dm, pp_axis)
    n = len(stage_graphs.graphs)
    if n != p * core.v:
        raise AssertionError(f"{n} stage graphs for {p} x {core.v} stages")
    local = [s for s in range(n) if core.placement[s] == pp_rank]
    modules, stages, moved = [], [], stage_graphs.layouts
    for s in local:
        module = fx.GraphModule(root, stage_graphs.graphs[s])
        modules.append(module)
        stages.append(
            PipelineStage(
                module, s, n, device, input_args=_example(compiled, stage_graphs.inputs[s], device, moved),
                output_args=_example(compiled, stage_graphs.outputs[s], device, moved), group=group,
            )  # both given: no shape-inference forward on uninitialized buffers
        )  # fmt: skip
    count_sends(stages, pp_axis)
    sched = make_schedule(stages, core, microbatches, scale_grads=False)  # a tied parameter on two local stages
    pipe = Pipelined(par, stage_graphs, local, modules, sched, core, group, microbatches)
    pipe.grad_divisor = microbatches
    return pipe


def count_sends(stages: list[PipelineStage], pp_axis: str) -> None:
    """Record in `COUNTER` the bytes of every send of these stages: torch's schedules build their
    forward and backward sends from the stage's `get_fwd_send_ops` / `get_bwd_send_ops`."""
    for stage in stages:
        for method, phase, step in (("get_fwd_send_ops", "forward", 1), ("get_bwd_send_ops", "backward", -1)):
            where = f"stage {stage.stage_index} -> {stage.stage_index + step}"
            setattr(stage, method, _counted(getattr(stage, method), phase, pp_axis, where))


def _counted(send_ops, phase: str, axis: str, where: str):
    def counted(chunk: int) -> list:
        ops = send_ops(chunk)
        for op in ops:
            COUNTER.record(phase, "send_recv", axis, op.tensor.numel() * op.tensor.element_size(), where)
        return ops

    return counted


def make_schedule(stages: list[PipelineStage], core, microbatches: int, loss_fn=_loss, *, scale_grads: bool = True):
    """The torch schedule that runs this rank's `stages` as the core schedule `core` says:
    torch's own class for GPipe, 1F1B, interleaved 1F1B and ZBV, and for ZB-H1 the core's
    action lists on torch's schedule runtime (which adds the sends and receives).

    `scale_grads=False` leaves the gradients summed over the microbatches (torch divides them
    per stage, so a parameter two stages of one rank share would be divided twice)."""
    name = core.name
    kw = dict(loss_fn=loss_fn, scale_grads=scale_grads)
    if name in _TORCH:
        cls = _TORCH[name]
        return cls(stages[0], microbatches, **kw) if name in ("gpipe", "1f1b") else cls(stages, microbatches, **kw)
    sched = _torch_schedules._PipelineScheduleRuntime(stages, microbatches, **kw)
    actions = {
        r: [_torch_schedules._Action(a.stage, _torch_schedules._ComputationType(a.kind), a.microbatch) for a in row]
        for r, row in enumerate(core.actions)
    }
    sched._prepare_schedule_with_comms(actions)
    return sched


def _example(compiled, names: list[str], device, layouts: dict | None = None) -> tuple:
    """Tensors shaped like these values for one microbatch on this rank (`output`: the loss).
    `layouts`: those of values the compiler's plans do not cover (collectives moved to a boundary)."""
    by_name = {n.name: n for n in compiled.graph.nodes}
    out = []
    for name in names:
        if name == "output":
            out.append(torch.zeros((), device=device))
            continue
        node = by_name[name]
        val = node.meta["val"]
        layout = value_layout(node, compiled.plans, compiled.input_layouts, layouts)
        shape = local_shape(tuple(val.shape), layout, compiled.axes.sizes) if layout is not None else tuple(val.shape)
        out.append(torch.zeros(shape, dtype=val.dtype, device=device, requires_grad=bool(val.requires_grad)))
    return tuple(out)


def tied_groups(stage_graphs, core, compiled, pp_axis: str):
    """For each parameter held by stages on different pp ranks, a process group over those ranks
    (one per coordinate of the other axes; every rank creates every group, in the same order)."""
    holders: dict[str, set[int]] = {}
    for s, names in enumerate(stage_graphs.params):
        for name in names:
            holders.setdefault(name, set()).add(core.placement[s])
    by_ranks: dict[tuple[int, ...], set[str]] = {}
    for name, ranks in holders.items():
        if len(ranks) > 1:
            by_ranks.setdefault(tuple(sorted(ranks)), set()).add(name)
    mesh = compiled.mesh
    others = [a for a in mesh.axis_names if a != pp_axis]
    me = dist.get_rank()
    out = []
    for pp_ranks, names in sorted(by_ranks.items()):
        for coords in itertools.product(*(range(mesh.axis_size(a)) for a in others)):
            ranks = [mesh.rank({**dict(zip(others, coords)), pp_axis: r}) for r in pp_ranks]
            group = dist.new_group(ranks)
            if me in ranks:
                out.append((names, group))
    return out


def parallelize_pipeline(
    model: nn.Module, /, *, mesh, rules, example_inputs, example_kwargs, loss, init, seed: int, sequence_parallel: bool,
    in_specs,
    zero, precision, recompute: str, microbatches: int, schedule: str, chunks: int | None, pp_axis: str,
    split_points, balance: str, timeout: float | None = None,
) -> Pipelined:
    """`parallelize` for a mesh with a pipeline axis (call on every rank; every check comes first)."""
    from . import dist as mdist
    from .parallel import Parallel, _cast_params, _dtype, executable, lower

    compiled, stages, core = compile_pipeline(
        model, mesh=mesh, rules=rules, example_inputs=example_inputs, example_kwargs=example_kwargs, loss=loss,
        sequence_parallel=sequence_parallel,
        in_specs=in_specs, zero=zero, precision=precision, recompute=recompute, microbatches=microbatches,
        schedule=schedule, chunks=chunks, pp_axis=pp_axis, split_points=split_points, balance=balance,
    )  # fmt: skip
    if isinstance(stages, EagerStages):
        from .eager_stages import build_eager

        return build_eager(
            model, compiled, stages, core, init=init, seed=seed, microbatches=microbatches, pp_axis=pp_axis,
            timeout=timeout,
        )  # fmt: skip
    name, n_stages = core.name, len(stages.graphs)
    dm = mdist.device_mesh(mesh, timeout=timeout)
    pp_rank = mesh.coords(dist.get_rank())[pp_axis]
    mine = {s for s in range(n_stages) if core.placement[s] == pp_rank}
    only = set().union(*(stages.params[s] for s in mine))
    opts = compiled.options
    compute = _dtype(opts.precision.param)
    root = lower(compiled, dm, model, init=init, seed=seed, buffer_dtype=compute, only=only)
    par = Parallel(compiled, root, dm)
    par.microbatches = microbatches  # it is called on the global batch, m microbatches of the compiled call
    if compute in (torch.bfloat16, torch.float16):
        par.fp32_init = _cast_params(root, compute)
    device = next((b.device for b in root.buffers()), torch.device("cpu"))
    stages.graphs = [executable(g, device) for g in stages.graphs]
    data_grad_sync(par, dm)
    pipe = build(
        par, stages, root,
        schedule_name=name, microbatches=microbatches, v=core.v, pp_axis=pp_axis, dm=dm, device=device,
    )  # fmt: skip
    pipe.tied_groups = tied_groups(stages, core, compiled, pp_axis)
    return pipe


def data_grad_sync(par, dm) -> None:
    """ZeRO-0 over the data axes: sum the gradients that are partial sums over them (`GradSync`)."""
    from . import dist as mdist
    from .optim import GradSync
    from .parallel import _dtype

    compiled = par.compiled
    if compiled.options.zero == 0 and compiled.data_axes:
        synced = {n: q for n, q in par.named_model_parameters().items() if n in compiled.synced_params}
        group = mdist.group(dm, compiled.data_axes)
        par.grad_sync = GradSync(synced, group, "_".join(compiled.data_axes), _dtype(compiled.options.precision.reduce))


def compile_pipeline(
    model: nn.Module, /, *, mesh, rules, example_inputs=(), example_kwargs=None, loss=None,
    sequence_parallel: bool = False, in_specs=None, zero=0, precision=None, recompute: str = "none",
    microbatches: int, schedule: str = "1f1b", chunks: int | None = None, pp_axis: str = "pp", split_points=None,
    balance: str = "flops", estimate_memory: bool = False,
):
    """The pure part of pipelining (no processes): checks, the compiled microbatch graph, its stages,
    the schedule, and the plan with both. `meshlib plan` uses it as it is.

    The stage cost is counted from shapes (each op's FLOPs as the model is traced, or parameter
    bytes); nothing runs on values. A model neither fx nor torch.export can trace is split by module
    FQN on the eager model (`EagerStages`, and a `Compiled` without a graph), its cost from a run of a
    meta copy; the plan's notes say so, with both reasons."""
    from meshlib.cost import zero_level

    from ..compiler.call import Call, bind_call
    from ..compiler.compile import compile_model
    from ..compiler.fqn_split import split_eager
    from ..compiler.split import layer_paths
    from ..compiler.stages import build_stages, graph_costs, layer_costs, stage_ranges
    from ..compiler.trace import Untraceable

    name, v = _schedule_name(schedule, chunks)
    p = mesh.axis_size(pp_axis)
    call = example_inputs
    if not isinstance(call, Call):
        call = bind_call(model, example_inputs, example_kwargs, loss=loss)
    batches = {n: x.shape[0] if x.dim() else None for n, x in call.tensors.items()}
    batch = next(iter(batches.values()))
    if any(b != batch for b in batches.values()):
        raise ValueError(
            f"the inputs' batch sizes differ ({batches}); a pipeline splits every input into microbatches "
            "along dim 0. Fix: give every tensor input the batch as its first dim"
        )
    if microbatches < 1 or batch is None or batch % microbatches:
        raise ValueError(
            f"the batch of {batch} does not split into {microbatches} microbatches. Fix: make the batch a "
            f"multiple of the microbatch count, or pick a count that divides {batch}"
        )
    if zero_level(zero) >= 2:
        raise ValueError(
            "pipeline parallelism composes with zero=0 or 1 here; ZeRO-2/3 (FSDP2) inside stages is not built yet"
        )
    core = core_schedule(name, p, microbatches, v)  # checks p, m and v before any communication
    micro = call.micro(microbatches)
    layers = layer_paths(model)
    try:
        compiled = compile_model(
            model, mesh=mesh, rules=rules, example_inputs=micro, in_specs=in_specs, sequence_parallel=sequence_parallel,
            zero=zero, precision=precision, recompute=recompute, estimate_memory=estimate_memory,
            count_flops=balance == "flops",
        )  # fmt: skip
    except Untraceable as reason:
        costs = layer_costs(model, layers, micro, by=balance)
        ranges = stage_ranges(costs, p * core.v, split_points=split_points)
        compiled, stages = split_eager(
            model, reason=reason, mesh=mesh, call=micro, layers=layers, ranges=ranges, costs=costs,
            in_specs=in_specs, zero=zero, precision=precision, recompute=recompute,
            sequence_parallel=sequence_parallel, pp_axis=pp_axis, microbatches=microbatches,
        )  # fmt: skip
        split = "by module FQN on the eager model"
    else:
        costs = graph_costs(compiled, model, layers, by=balance)
        ranges = stage_ranges(costs, p * core.v, split_points=split_points)
        stages = build_stages(
            compiled.graph, compiled.parts, ranges, len(layers), compiled.axes, compiled.plans, compiled.comms,
            compiled.input_layouts,
        )
        split = f"by layer FQN on the {compiled.traced.path} graph"
    stages.costs = costs.of(ranges)
    stages.balance = balance if split_points is None else "user split points"
    compiled.plan = _plan_with_stages(compiled.plan, stages, core, layers, microbatches, pp_axis, split)
    return compiled, stages, core


def _schedule_name(schedule: str, chunks: int | None) -> tuple[str, int | None]:
    from meshlib.schedules import _resolve

    return _resolve(schedule, chunks)


def _plan_with_stages(plan, stages, core, layers: list[str], m: int, pp_axis: str, split: str):
    """The plan's stages (layers, cost, what each sends per microbatch) and its pipeline traffic."""
    from meshlib import Collective, Stage

    records = []
    out = []
    for s, ((a, b), sends) in enumerate(zip(stages.layers, stages.sends)):
        mods = tuple(layers[a:b])
        out.append(Stage(s, core.placement[s], mods, stages.costs[s] if stages.costs else 0.0, tuple(sends)))
        if s + 1 < len(core.placement) and core.placement[s] == core.placement[s + 1]:
            continue  # the next stage is on this rank (the V's turn): torch hands the tensors over, no send
        for bnd in sends:
            records.append(
                Collective(
                    "send_recv", (pp_axis,), bnd.bytes, bnd.name, "pipeline", "", f"stage {s} -> {s + 1}",
                    "forward", m, 2,
                )
            )  # fmt: skip
            if bnd.grad:
                records.append(
                    Collective(
                        "send_recv", (pp_axis,), bnd.bytes, bnd.name, "pipeline", "", f"stage {s + 1} -> {s}",
                        "backward", m, 2,
                    )
                )  # fmt: skip
    notes = dict(plan.notes) | {"stage split": f"{split}, balanced by {stages.balance}"}
    return plan.replace(
        stages=tuple(out),
        schedule=core.name,
        microbatches=m,
        collectives=plan.collectives + tuple(records),
        notes=tuple(notes.items()),
    )


__all__ = ["Pipelined", "build", "make_schedule", "parallelize_pipeline", "placement", "tied_groups"]
