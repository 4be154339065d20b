"""What a step keeps for backward and what it runs again: recompute, and all-gathered values kept as shards.

`Recompute(block, mode)` runs a layer under torch's activation checkpointing:

- "block" keeps the layer's inputs only; backward runs its forward again, collectives
  included (Megatron's full recompute, torchtitan's full activation checkpointing);
- "selective" keeps the outputs of the layer's collectives and of its projections (mm,
  addmm) and attention kernels, and runs again the elementwise work and the attention
  scores of attention written with matmuls (torch's selective checkpointing policy).

Either way torch stops re-running a layer once everything its backward needs is back
(checkpoint's early stop), so a collective after the last op that keeps a tensor never
runs again. The plan counts what does, under the phase "recompute" (`compiler.saved`).

A collective's output is kept through a `Recompute` by caching it in the layer's
checkpoint contexts: the forward stores it and the recompute hands it back
(`comm_forward`). An all-gather's is not: what it gathers is whole-sized, so it is
gathered again, as outside recompute, where Megatron's sequence parallelism keeps only
the shard of a gathered value that backward needs and gathers it again there
(`keeping_shards`): the step without recompute already runs that all-gather in backward,
so selective recompute adds no communication to it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..torch_private import sac_saves_bypass_hooks, view_base

aten = torch.ops.aten

# selective recompute keeps these ops' outputs: projections and attention kernels (not bmm: the
# scores and their product with the values of attention written with matmuls are recomputed)
_KEEP = {
    aten.mm.default, aten.addmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default,
}  # fmt: skip


def _policy(ctx, op, *args, **kwargs):
    keep = op in _KEEP and not _STATE.blocks
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def blocks_recomputed():
    """Attention kernels called under it compute blocks of a context-parallel attention (one per shard of
    keys, merged after): selective recompute runs them again rather than keep each block's output, as it
    does the scores of attention written with matmuls (keeping them would hold cp outputs per layer)."""
    saved, _STATE.blocks = _STATE.blocks, True
    try:
        yield
    finally:
        _STATE.blocks = saved


class _State(threading.local):
    """The checkpoint region the current thread runs in: its cache of collective outputs, and
    whether this is the forward (recording) or the recompute (replaying)."""

    def __init__(self):
        self.cache: dict | None = None
        self.replay = False
        self.blocks = False


_STATE = _State()


def replaying() -> bool:
    """Whether recompute is replaying a checkpointed block's forward now (a statistic counts once)."""
    return _STATE.replay


def write_buffer(method: str, buffer: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`buffer.<method>(*args)`, a buffer write in the forward (a router's token count), skipped while
    recompute replays the forward: the write happens once per forward, as without recompute."""
    if _STATE.replay:
        return buffer
    # through `.data`: a statistic outside autograd, whose write must not bump the version a checkpointed
    # block's saved inputs are checked against in backward (the buffer is one of them)
    with torch.no_grad():
        getattr(buffer.data, method)(*args, **kwargs)
    return buffer


class _Region:
    """One of a checkpoint region's two contexts (`replay`: the recompute's)."""

    def __init__(self, cache: dict, replay: bool):
        self.cache, self.replay, self.saved = cache, replay, None

    def __enter__(self):
        self.saved = (_STATE.cache, _STATE.replay)
        _STATE.cache, _STATE.replay = self.cache, self.replay

    def __exit__(self, *exc):
        _STATE.cache, _STATE.replay = self.saved


def _contexts(mode: str):
    """checkpoint's `context_fn`: a forward and a recompute context sharing one cache."""
    cache: dict = {}
    mine = _Region(cache, False), _Region(cache, True)
    if mode != "selective":
        return mine
    sac = create_selective_checkpoint_contexts(_policy)
    # what SAC saves (projections' and attention's outputs, never an all-gathered value kept as its shard)
    # bypasses the saved-tensor hooks around it (`keeping_shards`'), as torch did before it asked
    sac_saves_bypass_hooks(sac[0])
    return _Both(sac[0], mine[0]), _Both(sac[1], mine[1])


class _Both:
    def __init__(self, *contexts):
        self.contexts, self.stack = contexts, None

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for c in self.contexts:
            self.stack.enter_context(c)

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


class Recompute(nn.Module):
    """Run `block` under activation checkpointing (`mode`: "block" or "selective")."""

    def __init__(self, block: nn.Module, mode: str):
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=partial(_contexts, self.mode))


@dataclass(frozen=True)
class Remat:
    """By collective name: those a recomputed layer runs again, and the all-gathers whose output
    backward gathers again (`compiler.saved.remat_of` finds them)."""

    rerun: frozenset[str] = frozenset()
    regather: frozenset[str] = frozenset()


def kept(spec, mode: str) -> bool:
    """Whether recompute keeps this collective's output (else it runs again): selective keeps every
    one but an all-gather, block none."""
    return mode == "selective" and not gathers(spec)


def gathers(spec) -> bool:
    """A collective that only gathers (an all-gather on every axis that changes): its input is a shard
    of its output, which can be gathered again where backward needs it."""
    from ..compiler.placement.placements import Shard, kind

    steps = [kind(a, b) for a, b in zip(spec.src, spec.dst)]
    return any(steps) and all(k in (None, "all_gather") for k in steps) and all(
        a == b or isinstance(a, Shard) for a, b in zip(spec.src, spec.dst)
    )


def comm_forward(name: str, keep: bool, run):
    """A collective's forward inside or outside a checkpoint region: `run(phase)` runs it. Its output
    is cached in the region's forward when `keep`, and handed back in the recompute; otherwise the
    recompute runs it again (phase "recompute")."""
    cache = _STATE.cache
    if cache is None:
        return run("forward")
    if _STATE.replay:
        if keep and name in cache:
            return cache.pop(name)
        return run("recompute")
    out = run("forward")
    if keep:
        cache[name] = out.detach()
    return out


# -- all-gathered values kept as their shards ------------------------------------------------------
def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns `t`'s storage (`t` itself unless it is a view)."""
    return view_base(t)


class _Gathered:
    """An all-gathered value backward may need: its shard, and how to gather it again (the value may be
    a view, as an uneven gather's is of its padded buffer: what is kept is the buffer's)."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, again):
        self.ref, self.shard, self.again = weakref.ref(_root(full)), shard, again
        self.full = None

    def take(self) -> torch.Tensor:
        """The whole buffer, gathered again on first use and kept while any consumer's saved copy lives:
        backward releases those as it goes, and a split backward (zero-bubble: input gradients, then
        weight gradients) keeps them from the first pass to the second, as it keeps the rest of its graph."""
        if self.full is None:
            with torch.no_grad():
                self.full = _root(self.again(self.shard))
        return self.full


class _Kept:
    """What a consumer saved in place of an all-gathered value (or a view of one)."""

    def __init__(self, gathered: _Gathered, t: torch.Tensor, whole: bool):
        self.gathered, self.whole = gathered, whole
        self.geometry = (tuple(t.shape), t.stride(), t.storage_offset())


class _Registry(threading.local):
    def __init__(self):
        self.active = 0
        self.values: dict[int, _Gathered] = {}


_GATHERED = _Registry()


def note_gathered(full: torch.Tensor, shard: torch.Tensor, again) -> None:
    """Record that `full` was all-gathered from `shard` (`again(shard)` gathers it once more), while a
    `keeping_shards` context is active: a consumer that saves it for backward keeps the shard."""
    if not _GATHERED.active:
        return
    root = _root(full)
    key = id(root)
    _GATHERED.values[key] = _Gathered(full, shard, again)
    weakref.finalize(root, _GATHERED.values.pop, key, None)


def _pack(t: torch.Tensor):
    base = _root(t)
    found = _GATHERED.values.get(id(base))
    if found is None or found.ref() is not base:
        return t
    return _Kept(found, t, t is base)


def _unpack(x):
    if not isinstance(x, _Kept):
        return x
    full = x.gathered.take()
    return full if x.whole else full.as_strided(*x.geometry)


@contextlib.contextmanager
def keeping_shards():
    """Saved tensors that are all-gathered values (or views of them) are kept as their shards and
    gathered again when backward unpacks them. Inside a checkpoint region torch's own hooks come
    first, and recompute gathers them again instead."""
    _GATHERED.active += 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _GATHERED.active -= 1


def keep_shards(module: nn.Module) -> nn.Module:
    """`module` with its forward under `keeping_shards` (its own structure unchanged)."""
    inner = module.forward

    def forward(*args, **kwargs):
        with keeping_shards():
            return inner(*args, **kwargs)

    module.forward = forward
    return module


__all__ = [
    "Remat", "Recompute", "blocks_recomputed", "comm_forward", "gathers", "keeping_shards", "keep_shards", "kept",
    "note_gathered",
]
