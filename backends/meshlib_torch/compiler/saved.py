"""What each op keeps for backward, and so what recompute and sequence parallelism run again.

`census(compiled)` runs one microbatch's forward of the local graph on meta
tensors (`dryrun.dry_module`: one rank's shapes, the compute dtype) under
torch's saved-tensor hooks and notes, for every node, the tensors autograd
saves while it runs and which node made each one (by storage, so views count
as the value they view). From that:

- `rerun`: the collectives a recomputed layer runs again. torch's checkpoint
  re-runs a layer's forward until the last tensor it saved is back (early
  stop), so a collective runs again when it is not kept (`remat.kept`) and some
  node at or after it in its layer saves a tensor;
- `regather`: the all-gathers whose output a node outside a recomputed layer
  saves: that node keeps the shard, and backward gathers it again
  (`remat.keeping_shards`);
- `stored`: the bytes each part (pre, layer i, post) keeps for backward
  without recompute, by the node that made them, for the plan's memory notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..torch_private import pytree
from .remat import Remat, gathers, kept


@dataclass
class Census:
    packs: dict[str, list[int]] = field(default_factory=dict)  # node -> keys of the storages it saved
    made: dict[int, str] = field(default_factory=dict)  # storage key -> the node whose value it is
    nbytes: dict[int, int] = field(default_factory=dict)  # storage key -> bytes
    order: dict[str, int] = field(default_factory=dict)  # node -> position in the graph

    def saved_by(self, names) -> dict[int, int]:
        """The storages the nodes in `names` save, with their bytes (each once)."""
        keys = {k for n in names for k in self.packs.get(n, ())}
        return {k: self.nbytes[k] for k in keys}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, census: Census):
        super().__init__(gm)
        self.census, self.current = census, None
        self.alive: list = []  # every value and saved tensor stays alive: a storage's key is never reused

    def run_node(self, n: fx.Node):
        self.current = n.name
        out = super().run_node(n)
        self.alive.append(out)
        for t in pytree.tree_leaves(out):
            if torch.is_tensor(t):
                self.census.made.setdefault(_key(t), n.name)
                self.census.nbytes.setdefault(_key(t), t.untyped_storage().nbytes())
        return out

    def pack(self, t: torch.Tensor):
        self.alive.append(t)
        key = _key(t)
        self.census.made.setdefault(key, self.current)  # made inside the op (a mask, statistics)
        self.census.nbytes.setdefault(key, t.untyped_storage().nbytes())
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
    for node in compiled.graph.nodes:
        spec = comms.get(node.target) if node.op == "call_module" else None
        if spec is None:
            continue
        part = parts.get(node.name, -1)
        if recomputed(part) and not kept(spec, mode) and found.order[node.name] < last.get(part, -1):
            rerun.add(spec.name)
        if gathers(spec) and any(not recomputed(parts.get(u, -1)) for u in savers.get(node.name, ())):
            regather.add(spec.name)
    return Remat(frozenset(rerun), frozenset(regather))


__all__ = ["Census", "census", "remat_of"]
