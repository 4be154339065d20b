"""What each op keeps for backward, and so what recompute and sequence parallelism run again.

`census(compiled)` runs one microbatch's forward of the local graph on meta
tensors (`dryrun.dry_module`: one rank's shapes, the compute dtype) under
torch's saved-tensor hooks and notes, for every node, the tensors autograd
saves while it runs and which node made each one (by storage, so views count
as the value they view). From that:

- `rerun`: the collectives a recomputed layer runs again. torch's checkpoint
  re-runs a layer's forward until the last tensor it saved is back (early
  stop), so a collective runs again when it is not kept (`modules.recompute.kept`) and some
  node at or after it in its layer saves a tensor;
- `regather`: the all-gathers whose output a node outside a recomputed layer
  saves: that node keeps the shard, and backward gathers it again
  (`modules.recompute.keeping_shards`);
- `kept_layers`: what each layer keeps for backward as the plan's recompute
  mode runs it (a second dry forward, each layer's live bytes after it less
  before), and what it saves without recompute value by value: the plan's
  `Kept`, which the memory tables print.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshlib import Kept

from ...modules.recompute import Recompute, Remat, gathers, keeping_shards, kept
from ...torch_private import pytree, storage_key


@dataclass
class Census:
    packs: dict[str, list[int]] = field(default_factory=dict)  # node -> keys of the storages it saved
    made: dict[int, str] = field(default_factory=dict)  # storage key -> the node whose value it is
    nbytes: dict[int, int] = field(default_factory=dict)  # storage key -> bytes
    order: dict[str, int] = field(default_factory=dict)  # node -> position in the graph
    inner: set[int] = field(default_factory=set)  # storages an op made for itself (not its output)
    outputs: dict[str, int] = field(default_factory=dict)  # node -> the storage of its (first) output


def _key(t: torch.Tensor) -> int:
    return storage_key(t)


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, census: Census):
        super().__init__(gm)
        self.census, self.current, self.fresh = census, None, set()
        self.alive: list = []  # every value and saved tensor stays alive: a storage's key is never reused

    def run_node(self, n: fx.Node):
        self.current, self.fresh = n.name, set()
        out = super().run_node(n)
        self.alive.append(out)
        for t in pytree.tree_leaves(out):
            if torch.is_tensor(t):
                self.census.outputs.setdefault(n.name, _key(t))
                self._note(_key(t), t, n.name)
                if _key(t) in self.fresh:
                    self.census.inner.discard(_key(t))
        return out

    def _note(self, key: int, t: torch.Tensor, maker: str) -> None:
        self.census.made.setdefault(key, maker)
        self.census.nbytes.setdefault(key, t.untyped_storage().nbytes())

    def pack(self, t: torch.Tensor):
        self.alive.append(t)
        key = _key(t)
        if key not in self.census.made:  # made by the running op: its output, or its own (a mask, statistics)
            self.fresh.add(key)
            self.census.inner.add(key)
        self._note(key, t, self.current)
        self.census.packs.setdefault(self.current, []).append(key)
        return t


def census(compiled, inputs: list[torch.Tensor]) -> Census:
    """Run the compiled graph's forward once on meta `inputs` (one microbatch on one rank), noting what
    each node saves for backward."""
    from .dryrun import dry_module

    gm, _ = dry_module(compiled, compiled.graph)
    found = Census(order={n.name: i for i, n in enumerate(compiled.graph.nodes)})
    recorder = _Recorder(gm, found)
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        recorder.run(*inputs)
    return found


def kept_layers(compiled, inputs: list[torch.Tensor], found: Census | None = None) -> tuple[Kept, ...]:
    """Per layer, the bytes its forward adds and keeps until its backward (one microbatch, one rank,
    the plan's recompute mode: a dry forward on meta, each layer's live bytes after it less before),
    and what it saves without recompute (`found`, by value)."""
    from ...memtrack import PeakTracker
    from ..capture.blocks import split_graph
    from .dryrun import dry_module

    mode = compiled.options.recompute
    gm, params = dry_module(compiled, compiled.graph)
    gm = split_graph(gm, {n.name: k for n, k in compiled.parts.items()}, compiled.layers)
    blocks = [getattr(gm, f"layer_{i}") for i in range(compiled.layers)]
    if mode != "none":
        for i, block in enumerate(blocks):
            setattr(gm, f"layer_{i}", Recompute(block, mode))
    live: list[int] = []  # before the first layer, then after each
    tracker = PeakTracker()
    hooks = [gm.layer_0.register_forward_pre_hook(lambda *_: live.append(tracker.live))]
    hooks += [getattr(gm, f"layer_{i}").register_forward_hook(lambda *_: live.append(tracker.live))
              for i in range(compiled.layers)]  # fmt: skip
    with tracker, keeping_shards():
        tracker.baseline([*params.values(), *gm.buffers(), *inputs])
        gm(*inputs)
    for h in hooks:
        h.remove()
    items = _items(compiled, found) if found is not None else {}
    return tuple(
        Kept(path, after - before, items.get(i + 1, ()))
        for i, (path, before, after) in enumerate(zip(compiled.layer_paths, live, live[1:]))
    )


def _items(compiled, found: Census) -> dict[int, tuple[tuple[str, int], ...]]:
    """Per part, what its nodes save for backward without recompute: activations only (not parameters
    or buffers), an all-gathered value counted as the shard its savers keep (`modules.recompute.keeping_shards`)."""
    nodes = {n.name: n for n in compiled.graph.nodes}
    parts = {n.name: k for n, k in compiled.parts.items()}
    comms = {c.name: c for c in compiled.comms}
    shard_of = {}  # an all-gather's output -> its input (what is kept instead)
    for n in compiled.graph.nodes:
        if n.op == "call_module" and n.target in comms and gathers(comms[n.target]):
            shard_of[n.name] = n.args[0].name
    key_of = found.outputs
    out: dict[int, dict[str, int]] = {}
    for saver, keys in found.packs.items():
        part = parts.get(saver)
        if part is None:
            continue
        for k in set(keys):
            maker = found.made[k]
            node = nodes.get(maker)
            if node is not None and _is_state(node):
                continue
            if maker in shard_of and shard_of[maker] in key_of:
                maker, k = shard_of[maker], key_of[shard_of[maker]]
            label = f"{maker} ({_op(nodes.get(maker))}{', kept by the op itself' if k in found.inner else ''})"
            out.setdefault(part, {}).setdefault(label, {})[k] = found.nbytes[k]
    out = {p: {label: sum(d.values()) for label, d in labels.items()} for p, labels in out.items()}
    return {p: tuple(sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))) for p, d in out.items()}


def _is_state(node: fx.Node) -> bool:
    """A parameter or buffer, or a parameter's local shard: model state, not an activation."""
    return node.op == "get_attr" or (node.op == "call_method" and node.target == "to_local")


def _op(node) -> str:
    if node is None:
        return "?"
    if node.op == "call_module":
        return "collective" if str(node.target).startswith("comm") else node.meta.get("op_name", str(node.target))
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def remat_of(compiled, found: Census) -> Remat:
    """What recompute re-runs and what backward gathers again, from what each node saves."""
    mode = compiled.options.recompute
    parts = {n.name: k for n, k in compiled.parts.items()}
    recomputed = (lambda part: 1 <= part <= compiled.layers) if mode != "none" else (lambda part: False)
    last: dict[int, int] = {}  # recomputed part -> position of its last node that saves a tensor
    for name, keys in found.packs.items():
        if keys and recomputed(parts.get(name, -1)):
            last[parts[name]] = max(last.get(parts[name], -1), found.order[name])
    comms = {c.name: c for c in compiled.comms}
    savers: dict[str, set[str]] = {}  # node -> the nodes that save its value (or a view of it)
    for name, keys in found.packs.items():
        for k in keys:
            savers.setdefault(found.made[k], set()).add(name)
    rerun, regather = set(), set()
    regions = {s.name for s in compiled.specials}  # their collectives are never cached: recompute runs them again
    for node in compiled.graph.nodes:
        spec = comms.get(node.target) if node.op == "call_module" else None
        part = parts.get(node.name, -1)
        again = recomputed(part) and found.order.get(node.name, -1) < last.get(part, -1)
        if node.op == "call_module" and node.target in regions and again:
            rerun.add(node.target)
        if spec is None:
            continue
        if again and not kept(spec, mode):
            rerun.add(spec.name)
        if gathers(spec) and any(not recomputed(parts.get(u, -1)) for u in savers.get(node.name, ())):
            regather.add(spec.name)
    return Remat(frozenset(rerun), frozenset(regather))


KEEPS = {
    "block": "each layer keeps its input; backward runs its forward again up to its last saved value, "
    "collectives included (phase recompute)",
    "selective": "each layer keeps what its collectives (but all-gathers), projections (mm) and attention "
    "kernels return; backward recomputes the rest, all-gathers included (phase recompute)",
}


def remat_notes(compiled) -> dict[str, str]:
    """The plan's words on what recompute keeps and what backward gathers again."""
    notes = {}
    if compiled.options.recompute in KEEPS:
        notes["recompute keeps"] = KEEPS[compiled.options.recompute]
    if compiled.remat.regather:
        notes["all-gathered values"] = (
            "an all-gathered value backward needs is kept as its shard and gathered again there, as Megatron's "
            f"sequence parallelism does ({len(compiled.remat.regather)} per microbatch)"
        )
    return notes


__all__ = ["Census", "census", "kept_layers", "remat_notes", "remat_of"]
