"""A dry run of one training step on the meta device: peak memory per rank with no processes.

The compiled local graph runs forward and backward on meta tensors of each
rank's local shapes. Collectives allocate their outputs (and their
gradients' outputs) but move nothing; the rank-dependent ops run their local
math. `PeakTracker` counts live bytes as it would on a real rank, so the
estimate covers activations, their gradients and the temporaries of every op,
under tensor and sequence parallelism and recompute. Model state comes from
the ZeRO level: parameters, optimizer moments and fp32 masters as the runtime
stores them; under ZeRO-2/3 the blocks' parameters are gathered (and freed)
around each block as FSDP2 does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from meshlib import Compute, StageCompute

from ...memtrack import PeakTracker
from ...modules.recompute import Recompute, comm_forward, gathers, keeping_shards, kept, note_gathered
from ...modules.special import special_module
from ...torch_private import copy_codegen, pipeline_keeps_grad_buffers, stage_backward_input, stage_backward_weight
from ..attrs import set_attr
from ..buckets import Buckets, grad_buckets, most_held
from ..capture.blocks import layer_paths, split_graph
from ..pipeline.stages import boundary_values, rank_params
from ..placement.placements import sync_axes
from ..placement.shapes import local_shape
from ..program import (
    Compiled,
    buffer_dtype,
    fsdp_whole,
    model_state,
    shard_ranks,
    zero1_in_backward,
    zero1_pieces,
)  # fmt: skip
from .opcount import OpCounter
from .stepmem import dry_zero1, optimizer_compute, step_extra


class _DryCollective(torch.autograd.Function):
    """Allocates what the real collective allocates (nothing when a direction does not communicate)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        out = comm_forward(comm.name, comm.keep, lambda phase: x.new_empty(comm.dst) if comm.moves_forward else x)
        if comm.gathers:
            note_gathered(out, x, lambda shard: shard.new_empty(comm.dst))
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad.new_empty(ctx.comm.src) if ctx.comm.moves_backward else grad), None


class DryComm(nn.Module):
    def __init__(self, spec, sizes, mode: str = "none"):
        super().__init__()
        self.name, self.keep, self.gathers = spec.name, kept(spec, mode), gathers(spec)
        self.src = local_shape(spec.shape, spec.src, sizes)
        self.dst = local_shape(spec.shape, spec.dst, sizes)
        self.moves_forward = spec.src != spec.dst
        self.moves_backward = spec.requires_grad and spec.grad_target() != spec.grad_dst

    def forward(self, x):
        return _DryCollective.apply(x, self)


def cpu_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """The kernel CPU runs use for attention, which torch's dispatcher picks on CPU for every dtype,
    mask and grouped-query shape (flash-for-CPU: it keeps q, k, v, the output and the log-sum-exp for
    backward); the meta device would otherwise take the math path, which keeps the whole attention
    matrix. A boolean mask becomes an additive one first, as torch does on CPU."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, -math.inf)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


_SDPA = {torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def _dry_graph(graph: fx.Graph) -> fx.Graph:
    """The compiled graph with parameters read directly (no DTensor), CPU's attention kernel, and the
    tensors it makes (masks, positions) made on the meta device, wherever it was traced."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    copy_codegen(graph, new)
    meta = lambda a: torch.device("meta") if isinstance(a, torch.device) else a  # noqa: E731
    for node in list(new.nodes):
        node.args, node.kwargs = fx.node.map_aggregate(node.args, meta), fx.node.map_aggregate(node.kwargs, meta)
        if node.op == "call_method" and node.target == "to_local":
            node.replace_all_uses_with(node.args[0])
            new.erase_node(node)
        elif node.op == "call_function" and node.target in _SDPA:
            node.target = cpu_attention
    return new


def dry_module(compiled: Compiled, graph: fx.Graph, every_param: bool = False) -> tuple[fx.GraphModule, dict]:
    """`graph` (the compiled graph, or a stage's) on meta tensors of one rank's local shapes: parameters
    (all of them with `every_param`, else those it reads) and buffers in the compute dtype, the
    collectives as `DryComm`s and the rank-dependent ops' local math. Returns it and its parameters."""
    opts = compiled.options
    compute = getattr(torch, opts.precision.param)
    comms = {c.name: c for c in compiled.comms}
    specials = {c.name: c for c in compiled.specials}
    root, params = nn.Module(), {}
    read = {n.target for n in graph.nodes if n.op == "get_attr"}
    for name, p in compiled.traced.params.items():
        if every_param or name in read:
            t = torch.empty(compiled.local_param_shape(name), dtype=compute, device="meta")
            params[name] = nn.Parameter(t, requires_grad=p.requires_grad)
            set_attr(root, name, params[name])
    for name, b in compiled.buffers.items():
        if name in read:
            set_attr(root, name, torch.empty(tuple(b.shape), dtype=buffer_dtype(compiled, name, b), device="meta"))
    for node in graph.nodes:
        if node.op == "call_module" and node.target in comms:
            root.add_module(node.target, DryComm(comms[node.target], compiled.axes.sizes, opts.recompute))
        elif node.op == "call_module" and node.target in specials:
            root.add_module(node.target, special_module(specials[node.target], {}))
    return fx.GraphModule(root, _dry_graph(graph)), params


def dry_peak(compiled: Compiled, model: nn.Module, *, batch: tuple) -> dict[str, int]:
    """Estimated bytes per rank: the peak during a step, and its parts (model state, step extra)."""
    opts = compiled.options
    compute = getattr(torch, opts.precision.param)
    full = next(iter(compiled.traced.params.values())).dtype
    mixed = compute in (torch.bfloat16, torch.float16)
    gm, params = dry_module(compiled, compiled.graph, every_param=True)
    layers = len(layer_paths(model))
    if opts.recompute != "none" or opts.zero >= 2:
        gm = split_graph(gm, {n.name: k for n, k in compiled.parts.items()}, layers)
    if opts.recompute != "none":
        for i in range(layers):
            setattr(gm, f"layer_{i}", Recompute(getattr(gm, f"layer_{i}"), opts.recompute))
    ranks = {name: shard_ranks(compiled, name) for name in params}  # an expert weight's: the data ranks besides ep
    state = _model_state(compiled, params, full, mixed, ranks)
    tracker = PeakTracker()
    with tracker:
        tracker.baseline(state["tensors"] + [b for b in gm.buffers()])
        base = tracker.live
        hooks = []
        if opts.zero >= 2:  # the gathered copies: charged by the hooks while FSDP would hold them
            tracker.ignore(params.values())
            shards = {id(p): ranks[name] for name, p in params.items()}
            hooks = _fsdp_hooks(gm, layers, tracker, opts.zero, shards, full.itemsize)
        if opts.zero == 0 and compiled.data_axes:  # ZeRO-0's buckets, held while they are summed
            reduce, order = getattr(torch, opts.precision.reduce), list(compiled.traced.params)
            hooks.append(_DryBuckets(params, _sync_groups(compiled, params), reduce, order))
        zero1 = dry_zero1(compiled) if zero1_in_backward(compiled) else None
        if zero1 is not None:  # ZeRO-1's reduce-scatters behind backward: their buffers and pieces
            hooks += zero1.watch({n: params[n] for n in zero1.shapes})
        local = [local_input(compiled, name, x) for name, x in zip(compiled.input_names, batch)]
        with OpCounter() as counter:
            with keeping_shards():
                loss = gm(*local)
            loss = loss[0] if isinstance(loss, (tuple, list)) else loss
            forward = tracker.live
            loss.backward()
    for h in hooks:
        h.remove()
    update = base + model_state(compiled).grads + step_extra(compiled)  # the optimizer's step
    peak = max(tracker.peak, update)
    passes = counter.computes()
    compute = StageCompute(*(passes.get(p, Compute()) for p in ("forward", "backward", "recompute")),
                           optimizer=optimizer_compute(compiled))  # fmt: skip
    return {"peak": peak, "model_state": base, "step": peak - base, "after_forward": forward, "compute": compute}


class _DryBuckets(Buckets):
    """`GradSync` on the meta device: the same buckets, started and waited for at the same moments of
    backward, their buffers allocated (the tracker counts them) and summed by nobody."""

    def reduce(self, buf: torch.Tensor, bucket):
        return self

    def wait(self) -> None:
        pass


def _sync_groups(compiled: Compiled, names) -> dict[str, tuple | None]:
    """ZeRO-0's sums, as `GradSync` takes them: per parameter in `names`, (no group, the name of the data
    axes its gradient is summed over), or None."""
    out = {}
    for name in names:
        axes = sync_axes(compiled.param_layouts[name], compiled.axes.names, compiled.data_axes)
        out[name] = (None, "_".join(axes)) if axes and name in compiled.synced_params else None
    return out


def _bucket_sizes(compiled: Compiled, names) -> list[int]:
    """The bytes of each of ZeRO-0's buckets over the parameters `names`, in the order they start."""
    if compiled.options.zero != 0 or not compiled.data_axes:
        return []
    size = getattr(torch, compiled.options.precision.reduce).itemsize
    groups = _sync_groups(compiled, [n for n in compiled.traced.params if n in names])
    entries = [
        (n, g[1], math.prod(compiled.local_param_shape(n)) * size)
        for n, g in groups.items() if g is not None and compiled.traced.params[n].requires_grad
    ]  # fmt: skip
    return [nbytes for _, _, nbytes in grad_buckets(entries)]


def local_input(compiled: Compiled, name: str, x: torch.Tensor) -> torch.Tensor:
    shape = local_shape(tuple(x.shape), compiled.input_layouts[name], compiled.axes.sizes)
    return torch.empty(shape, dtype=x.dtype, device="meta")


def _model_state(compiled, params, full, mixed, ranks: dict[str, int]) -> dict:
    """The tensors a rank holds between steps, as meta tensors: parameters (sharded under
    ZeRO-3 and -2's rest, over each one's `ranks`), fp32 masters (mixed precision, sharded from ZeRO-1),
    two moments."""
    zero = compiled.options.zero
    pieces = zero1_pieces(compiled)  # None: ZeRO-1 keeps it whole, with a full-precision master copy
    whole = fsdp_whole(compiled) if zero >= 2 else set()
    out = []
    for name, p in params.items():
        numel = p.numel()
        if zero >= 2 and name not in whole:  # FSDP2: a full-precision shard is the parameter (and the master)
            out.append(torch.empty(math.ceil(numel / ranks[name]), dtype=full, device="meta"))
            moments = math.ceil(numel / ranks[name])
        else:
            out.append(p)
            moments = pieces.get(name, numel) or numel  # rank 0's piece under ZeRO-1
            if mixed or (name in pieces and pieces[name] is None):
                out.append(torch.empty(moments, dtype=full, device="meta"))
        out += [torch.empty(moments, dtype=full, device="meta") for _ in range(2)]
    return {"tensors": out}


def _fsdp_hooks(
    gm: nn.Module, layers: int, tracker: PeakTracker, zero: int, shards: dict[int, int], full_itemsize: int
) -> list:
    """Charge FSDP2's memory as it moves.

    A gather allocates the all-gather's flat output, copies it out into the
    parameters and frees it; a block's forward also gathers the next block
    (forward prefetch), its backward the previous one. ZeRO-3 frees a block
    after its forward and after its backward, ZeRO-2 only after its backward.
    After a block's backward its gradients are copied into a flat buffer,
    reduce-scattered into a full-precision shard and freed. The root's
    parameters (embedding, final norm, head) are charged for the whole step.
    FSDP2 frees them after forward and gathers them again when backward
    starts, which is where the peak falls (logits and their gradient alive),
    so the charge matches the step's peak though not every moment of it.
    """
    handles = []
    blocks = [getattr(gm, f"layer_{i}") for i in range(layers)]
    block_params = {id(p) for b in blocks for p in b.parameters()}
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    root = size(p for p in gm.parameters() if id(p) not in block_params)
    tracker.account(2 * root)
    tracker.account(-root)
    held = [False] * layers

    def gather(i: int) -> None:
        if 0 <= i < layers and not held[i]:
            held[i] = True
            b = size(blocks[i].parameters())
            tracker.account(2 * b)  # the flat all-gather output and the copies out of it
            tracker.account(-b)

    def release(i: int) -> None:
        if held[i]:
            held[i] = False
            tracker.account(-size(blocks[i].parameters()))

    def after_backward(i: int) -> None:
        grads = [p for p in blocks[i].parameters() if p.grad is not None]
        flat = sum(p.numel() for p in grads) * full_itemsize
        tracker.account(flat)  # the reduce-scatter's flat input
        kept = sum(math.ceil(p.numel() / shards.get(id(p), 1)) for p in grads) * full_itemsize
        for p in grads:
            p.grad = None
        tracker.account(kept - flat)  # its output shard stays (each over its own ranks); the input is freed
        release(i)

    def both(first: int, second: int) -> None:  # hooks must return None (a value replaces the args)
        gather(first)
        gather(second)

    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: both(i, i + 1)))
        if zero == 3 and i < layers - 1:  # FSDP2 keeps the last block gathered: backward starts with it
            handles.append(block.register_forward_hook(lambda m, a, o, i=i: release(i)))
        handles.append(block.register_full_backward_pre_hook(lambda m, g, i=i: both(i, i - 1)))
        handles.append(block.register_full_backward_hook(lambda m, gi, go, i=i: after_backward(i)))
    return handles


# -- a pipeline: each stage on its own, then each rank's schedule ------------------------------------
@dataclass(frozen=True)
class StageRun:
    """One microbatch through a stage, in bytes above its parameters: what its forward keeps for the
    backward, the most live in its forward, and in its forward and backward. With a split backward
    (zero-bubble schedules): what stays after the input-gradient pass (the graph torch keeps for the
    weight pass, and the gradients saved for it), and the most live in that pass and in the weight pass."""

    kept: int
    forward: int
    step: int
    after_input: int = 0
    input_peak: int = 0
    weight_peak: int = 0
    compute: StageCompute = StageCompute()  # what one microbatch computes on this stage, pass by pass


def _stage_run(compiled: Compiled, s: int, split: bool = False, inputs: tuple | None = None) -> StageRun:
    """One microbatch through stage `s` on meta tensors (`split`: its backward as an I then a W action,
    through torch's own `stage_backward_input` / `stage_backward_weight`); `inputs`: the stage's boundary
    values, where the caller has made them."""
    stages, opts = compiled.stages, compiled.options
    gm, by_name = dry_module(compiled, stages.graphs[s])
    params = list(by_name.values())
    for p in params:  # a weight's gradient is in the model state already: here it only passes through
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    if opts.recompute != "none":
        gm = split_graph(gm, {n.name: k for n, k in compiled.parts.items()}, compiled.layers)
        for name, child in list(gm.named_children()):
            if name.startswith("layer_"):
                setattr(gm, name, Recompute(child, opts.recompute))
    if inputs is None:
        inputs = _stage_inputs(compiled, s)
    tracker, counter = PeakTracker(), OpCounter()
    with tracker, counter:
        run = _stage_pass(gm, params, inputs, tracker, counter, split)
    passes = counter.computes()
    compute = StageCompute(*(passes.get(p, Compute()) for p in ("forward", "backward", "recompute")),
                           weight=passes.get("weight") if split else None)  # fmt: skip
    return dataclasses.replace(run, compute=compute)


def _stage_inputs(compiled: Compiled, s: int) -> tuple:
    return boundary_values(compiled, compiled.stages.inputs[s], "meta", compiled.stages.layouts)


@dataclasses.dataclass(frozen=True)
class _Lookups:
    """What `stage_key` looks nodes up in, built once for all of a model's stages."""

    comms: dict
    specials: dict
    parts: dict  # node name -> its part, where recompute splits the stages into parts

    @classmethod
    def of(cls, compiled: Compiled) -> _Lookups:
        parts = {n.name: k for n, k in compiled.parts.items()} if compiled.options.recompute != "none" else {}
        return cls({c.name: c for c in compiled.comms}, {c.name: c for c in compiled.specials}, parts)


def stage_key(compiled: Compiled, s: int, inputs: tuple, lookups: _Lookups) -> tuple:
    """What decides stage `s`'s dry run, with node names left out: each node's op and target, its arguments
    (earlier nodes by position), the local shape and dtype of what it reads, its collective's layouts, its
    part (pre, a layer, post: by order within the stage) and the boundary values it receives (`inputs`).
    Two stages with the same key run the same ops on the same shapes (a deep model's middle stages do)."""
    graph, opts = compiled.stages.graphs[s], compiled.options
    compute = getattr(torch, opts.precision.param)
    comms, specials, parts = lookups.comms, lookups.specials, lookups.parts
    params, buffers = compiled.traced.params, compiled.buffers
    order = {k: i for i, k in enumerate(sorted({parts[n.name] for n in graph.nodes if n.name in parts}))}
    index = {n: i for i, n in enumerate(graph.nodes)}
    at = lambda a: ("node", index[a]) if isinstance(a, fx.Node) else a  # noqa: E731
    key = []
    for n in graph.nodes:
        target = n.target
        if n.op == "get_attr" and target in params:
            target = (tuple(compiled.local_param_shape(target)), compute, params[target].requires_grad)
        elif n.op == "get_attr" and target in buffers:
            target = (tuple(buffers[target].shape), buffer_dtype(compiled, target, buffers[target]))
        elif n.op == "call_module" and target in comms:
            c = comms[target]
            target = (c.src, c.dst, c.grad_dst, c.grad_out, c.shape, c.dtype, c.requires_grad)
        elif n.op == "call_module" and target in specials:
            target = (specials[target].kind, repr(specials[target].args))
        elif n.op == "placeholder":
            target = index[n]
        args = repr(fx.node.map_aggregate((n.args, n.kwargs), at))
        key.append((n.op, target if n.op != "call_function" else repr(target), args, order.get(parts.get(n.name))))
    return tuple(key), tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in inputs)


def _stage_pass(gm, params, inputs, tracker: PeakTracker, counter: OpCounter, split: bool) -> StageRun:
    tracker.ignore(params)
    tracker.baseline([*inputs, *gm.buffers()])
    base = tracker.live
    with keeping_shards():
        out = gm(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    outs = [t for t in outs if torch.is_tensor(t) and t.requires_grad]
    kept, forward = tracker.live - base, tracker.peak - base
    if not outs:
        return StageRun(kept, forward, forward)
    needs = [x for x in inputs if x.requires_grad]
    if not split or not needs:  # the first stage's I does nothing: its W is the whole backward
        if split:
            counter.phase = "weight"
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        step = tracker.peak - base
        return StageRun(kept, forward, step, kept, kept, step) if split else StageRun(kept, forward, step)
    grads = [torch.ones_like(t) for t in outs]
    _, groups = stage_backward_input(outs, grads, needs, iter(params))
    del grads, outs, out
    after, input_peak = tracker.live - base, tracker.peak - base
    tracker.reset_peak()
    counter.phase = "weight"
    stage_backward_weight(iter(params), groups)
    for p in params:
        p.grad = None  # in the model state already (see above): stage_backward_weight sets it directly
    weight_peak = tracker.peak - base
    return StageRun(kept, forward, input_peak, after, input_peak, weight_peak)


def stage_peaks(compiled: Compiled, core, state: list[int], grads: list[int]) -> tuple[list[int], list[StageCompute]]:
    """Each pp rank's peak bytes in a step: what it holds throughout (`state`: parameters and
    optimizer state), its stages' parameters in the compute dtype where ZeRO-2/3 keeps them gathered
    through the step, the activations its schedule keeps in flight, and the weight gradients from a
    stage's first backward on (`grads`, per stage: the optimizer step frees them), or at the optimizer
    step the gradients and what the update makes (`stepmem.step_extra`) or the buffers of ZeRO-0's buckets
    as the flush after the schedule sums them (`buckets.most_held`). Walking the
    rank's actions, a forward adds its stage's kept bytes and a backward frees them (a stage's first
    backward turns them into its weight gradients as it goes); a zero-bubble schedule's input-gradient
    action keeps them, with the gradients saved for the weight action, which frees them. The peak is
    the most in flight plus the transient of the action running then (`_stage_run`), and the buffers
    the stages receive into (`_receive_buffers`). Also, per stage, what one microbatch computes there."""
    split = any(a.kind == "I" for actions in core.actions for a in actions)
    runs, done, lookups = [], {}, _Lookups.of(compiled)
    for s in range(len(compiled.stages.graphs)):  # alike stages (a deep model's middle ones) run once
        inputs = _stage_inputs(compiled, s)
        key = stage_key(compiled, s, inputs, lookups)
        if key not in done:
            done[key] = _stage_run(compiled, s, split, inputs)
        runs.append(done[key])
    recv = _receive_buffers(compiled.stages, core)
    opts = compiled.options
    compute = getattr(torch, opts.precision.param).itemsize
    out = []
    for r, (actions, names) in enumerate(zip(core.actions, rank_params(compiled.stages, core.placement))):
        gathered = 0
        if opts.zero >= 2:
            gathered = sum(math.prod(compiled.local_param_shape(n)) for n in names) * compute
        live = top = 0
        started: set[int] = set()
        for a in actions:
            run = runs[a.stage]
            if a.kind == "F":
                top = max(top, live + run.forward)
                live += run.kept
            elif a.kind == "I":  # torch keeps the stage's graph for the weight pass, and the grads it needs
                top = max(top, live - run.kept + run.input_peak)
                live += run.after_input - run.kept
            elif a.kind in ("B", "W"):
                new = 0
                if a.stage not in started:  # its weight gradients appear as its activations go
                    started.add(a.stage)
                    new = grads[a.stage]
                held, peak = (run.kept, run.step) if a.kind == "B" else (run.after_input, run.weight_peak)
                top = max(top, live - held + max(peak, new + peak - held))
                live += new - held
        held = sum(grads[s] for s, rank in enumerate(core.placement) if rank == r)
        update = held + max(step_extra(compiled, names), most_held(_bucket_sizes(compiled, names)))  # or the flush
        out.append(state[r] + recv[r] + max(gathered + top, update))
    return out, [run.compute for run in runs]


def _receive_buffers(stages, core) -> list[int]:
    """Per pp rank, the bytes torch's pipeline stages receive into through a step: one buffer per
    microbatch for each stage's input but the first's; and, where the installed torch keeps them for
    the run (`pipeline_keeps_grad_buffers`: 2.13 does), one per microbatch for the gradient of each
    stage's output but the last's."""
    out = [0] * len(core.actions)
    grads = pipeline_keeps_grad_buffers()
    for s, rank in enumerate(core.placement):
        if s > 0:
            out[rank] += core.m * sum(b.bytes for b in stages.sends[s - 1])
        if grads and s < len(core.placement) - 1:
            out[rank] += core.m * sum(b.bytes for b in stages.sends[s] if b.grad)
    return out
