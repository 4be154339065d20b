"""The optimizer side of data parallelism: ZeRO-1, master weights, loss scaling.

- `MeshOptimizer` (`MeshAdamW` its default AdamW): AdamW over fp32 master weights when the parameters are bf16 or
  fp16; with `zero=1` each data-parallel rank keeps only its shard of the
  masters and moments: the gradients are reduce-scattered into them and the
  updated shards all-gathered back into the parameters, many in one collective
  (`zero1.Zero1Sync`, in DDP's buckets). A tensor no dim of
  which divides by the data-parallel size is split in torch.chunk's sizes
  (as DTensor and FSDP2 do), its collectives padded to equal pieces. Masters are DTensors
  (the shard is a strided split of the parameter's own layout), so
  checkpoints reload on any mesh. ZeRO-2/3 leave the masters to FSDP2.
- `LossScaler`: dynamic loss scaling for fp16, with the overflow check agreed
  on by every rank.
"""

from __future__ import annotations

import inspect
import math
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compiler.placement import placements as pl
from ..compiler.placement.shapes import ragged_dims
from ..compiler.zero1_buckets import DataGroup
from ..torch_private import local_tensor
from .comm import COUNTER, CommCounter
from .dtensor import torch_placements
from .zero1 import Zero1Sync


class MeshOptimizer(torch.optim.Optimizer):
    """Any torch.optim optimizer over the compiled model's parameters, with fp32 masters for bf16/fp16
    parameters and ZeRO-1 sharding of its state.

    The optimizer class (`optimizer`, default AdamW) and its arguments (`options`) are the user's. It
    updates each parameter's master where there is one (a bf16/fp16 parameter's fp32 copy, or ZeRO-1's
    shard of it), so its state is sharded exactly as the masters are; the updated master is copied or
    all-gathered back into the parameter. Under ZeRO-1 the gradients are reduce-scattered behind backward
    while gradient sync is on (`Parallel.set_gradient_sync`; `Zero1Sync.watch`), or else in the step, and
    `step` frees the gradient of each parameter it splits (`.grad` is None after it), as FSDP2 frees an
    unsharded gradient.
    `reduce_gradients` (which clipping calls) runs that summing ahead of the step; a backward run between
    it and the step is refused at the step, as its gradients would not be in the sums applied.
    This is a `torch.optim.Optimizer` whose `param_groups` and `state` are the inner optimizer's, so
    learning-rate schedulers drive it as they drive any other.
    """

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        zero: int = 0,
        master: bool = False,
        groups: dict[str, DataGroup | None] | None = None,
        layouts: dict | None = None,
        mesh_axes=None,
        fp32_init: dict | None = None,
        reduce_dtype: torch.dtype | None = None,
        counter: CommCounter = COUNTER,
        order=(),
        **options,
    ):
        self.params, self.zero, self.counter = params, zero, counter
        self.reduce_dtype = reduce_dtype  # ZeRO-1's gradient sums run in it (None: the master's dtype)
        fp32_init = fp32_init or {}
        self.groups = {name: (groups or {}).get(name) for name in params}  # ZeRO-1's, per parameter
        self.master: dict[str, torch.Tensor] = {}
        self.shard_dim: dict[str, int | None] = {}
        for name, p in params.items():
            start = fp32_init.get(name, p.data)  # the fp32 values a bf16/fp16 parameter was rounded from
            if zero == 1 and self._spread(name):
                self.master[name] = self._sharded_master(name, p, start, layouts[name], mesh_axes, name in fp32_init)
            elif name in fp32_init or (master and zero < 2):
                self.master[name] = _fp32_copy(start)  # (under ZeRO-2/3: a parameter FSDP2 leaves whole)
        self.buckets = self._buckets(order)
        targets = [self.master.get(n, p) for n, p in params.items()]
        if "foreach" in inspect.signature(optimizer).parameters:
            options.setdefault("foreach", False)  # one tensor at a time: DTensor shards of every layout
        split = [n for n, t in zip(params, targets) if tuple(local_tensor(t).shape) != tuple(t.shape)]
        if split:
            check_elementwise(optimizer, options, split)
        self.inner = optimizer(targets, **options)
        super().__init__(targets, dict(self.inner.defaults))
        self.param_groups, self.state = self.inner.param_groups, self.inner.state  # one set: schedulers see it
        self.scaler: LossScaler | None = None
        self._ready: dict[str, torch.Tensor] | None = None  # `reduce_gradients`', until the step applies them
        self._late: set[str] = set()  # gradients a backward added to after `reduce_gradients` took them
        me = weakref.ref(self)  # the parameters' hooks must not keep a dropped optimizer's state alive
        for name, p in params.items():  # those it copies into a master, or reduce-scatters and frees
            if name in self.master and p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _, name=name: me() is not None and me()._arrived(name))
        if self.buckets is not None:  # ZeRO-1's reduce-scatters behind backward, while gradient sync is on
            self.buckets.watch({n: params[n] for n in self.buckets.shapes})

    def _spread(self, name: str) -> bool:
        """Whether ZeRO-1 spreads this parameter's state over more than one rank."""
        g = self.groups[name]
        return g is not None and g.size > 1

    def _buckets(self, order) -> Zero1Sync | None:
        """The buckets ZeRO-1 moves the split parameters in, those in registration order (`order`: the
        traced model's, as the plan lists them; names not in it after)."""
        first = {n: i for i, n in enumerate(order)}
        split = sorted((n for n, d in self.shard_dim.items() if d is not None), key=lambda n: first.get(n, len(first)))
        if not split:
            return None
        shapes = {n: tuple(local_tensor(self.params[n]).shape) for n in split}
        reduce = self.reduce_dtype or _master_dtype(local_tensor(self.params[split[0]]))
        return Zero1Sync(shapes, {n: self.shard_dim[n] for n in split}, self.groups, reduce, self.counter)

    # -- masters ---------------------------------------------------------------------------------
    def _sharded_master(
        self, name: str, p: torch.nn.Parameter, start, layout, mesh_axes, separate: bool
    ) -> torch.Tensor:
        local, g = local_tensor(start), self.groups[name]
        ragged = ragged_dims(tuple(p.shape), layout, mesh_axes.sizes)
        d = pl.zero1_shard_dim(tuple(local.shape), g.size, layout, ragged, len(g.axes))
        self.shard_dim[name] = d
        if d is None:  # a scalar, or every dim already split by another axis: every rank keeps the whole
            return _fp32_copy(start)
        piece = local.narrow(d, *pl.chunk_rows(local.shape[d], g.size, g.index)).detach()
        if separate or piece.dtype != _master_dtype(local):
            piece = piece.to(_master_dtype(local)).clone()  # a separate fp32 master (bf16/fp16 parameters)
        # else: a full-precision parameter is its own master: the shard is a view into it
        placements = _master_layout(layout, mesh_axes, g.axes, d)
        global_shape = tuple(p.shape)
        dt = DTensor.from_local(
            piece, p.device_mesh, torch_placements(placements), shape=global_shape, stride=p.stride()
        )
        return torch.nn.Parameter(dt)

    # -- the step -------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._ready, self._late = None, set()
        if self.buckets is not None:
            self.buckets.discard()
        for p in self.params.values():
            p.grad = None
        for m in self.master.values():
            m.grad = None

    @torch.no_grad()
    def reduce_gradients(self) -> dict[str, torch.Tensor]:
        """The gradients this step's update applies, by parameter name, each summed over the data axes:
        under ZeRO-1 this rank's reduce-scattered piece (the parameter's own gradient freed) or the
        all-reduced whole, else the master's or the parameter's gradient. `step` calls it; call it before
        (`Parallel.clip_grad_norm_` does) to read or scale them: the step then applies them as they are."""
        if self._ready is not None:
            return self._ready
        summed = self._reduce_scatter()
        ready = {}
        for name, p in self.params.items():
            m = self.master.get(name)
            if name in summed:
                m.grad = _as_like(m, summed[name].to(m.dtype))
            elif p.grad is None:
                continue
            elif m is None:
                ready[name] = p.grad
                continue
            elif self.zero == 1 and self._spread(name):  # kept whole (see `zero1_shard_dim`): sum it
                g, group = local_tensor(p.grad).to(self.reduce_dtype or m.dtype).contiguous(), self.groups[name]
                dist.all_reduce(g, group=group.group)
                self.counter.record("backward", "all_reduce", group.axis, g.numel() * g.element_size(), "zero-1")
                m.grad = _as_like(m, g.to(m.dtype))
            else:
                m.grad = _as_like(m, local_tensor(p.grad).to(m.dtype))
            ready[name] = m.grad
        self._ready = ready
        return ready

    def _arrived(self, name: str) -> None:
        if self._ready is not None:
            self._late.add(name)

    def _check_unchanged(self) -> None:
        """Refuse to step on sums a later backward has outdated: a gradient that `reduce_gradients` copied
        into a master, or reduce-scattered and freed, that a backward has since added to or made again."""
        if self._late:
            changed = sorted(self._late)
            names = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise RuntimeError(
                f"the gradients of {names} changed after opt.reduce_gradients() (or clipping) summed them: a backward "
                "ran in between, and the step would apply the sums taken before it. Fix: run every backward of the "
                "step first, then clip and step (train_step does), or call opt.zero_grad() to start the step over"
            )

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """One update; False when fp16 loss scaling found an overflow and skipped it."""
        if closure is not None:
            raise TypeError("MeshOptimizer.step takes no closure: the model's step runs the forward and backward")
        self._check_unchanged()
        self.reduce_gradients()
        self._ready = None
        grads = [t.grad for g in self.inner.param_groups for t in g["params"] if t.grad is not None]
        if self.scaler is not None and not self.scaler.unscale_and_check(grads):
            return False
        self.inner.step()
        for name, p in self.params.items():
            m = self.master.get(name)
            if m is not None and (self.buckets is None or name not in self.buckets.shapes):
                local_tensor(p.data).copy_(local_tensor(m.data))
        if self.buckets is not None:
            names = self.buckets.shapes
            self.buckets.all_gather({n: local_tensor(self.master[n].data) for n in names},
                                    {n: local_tensor(self.params[n].data) for n in names})  # fmt: skip
        return True

    def _reduce_scatter(self) -> dict[str, torch.Tensor]:
        """This rank's piece of each split parameter's summed gradient (`Zero1Sync`, which frees the
        parameter's own gradient once its bucket holds it): where backward made none, none; the pieces'
        padding moves too and is counted. Those the last backward reduce-scattered, while its gradients are
        unchanged since (`Zero1Sync.take`); else they are reduce-scattered now."""
        if self.buckets is None:
            return {}
        params = {n: self.params[n] for n in self.buckets.shapes}
        landed = self.buckets.take(params)
        return landed if landed is not None else self.buckets.reduce_scatter(params)

    # -- state ------------------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: moments, plus masters where they are separate copies."""
        own = {local_tensor(p.data).untyped_storage().data_ptr() for p in self.params.values()}
        total = sum(
            local_tensor(m.data).numel() * local_tensor(m.data).element_size()
            for m in self.master.values()
            if local_tensor(m.data).untyped_storage().data_ptr() not in own
        )
        for state in self.inner.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += local_tensor(v).numel() * local_tensor(v).element_size()
        return total


def check_elementwise(optimizer: type[torch.optim.Optimizer], options: dict, split: list[str]) -> None:
    """Raise unless `optimizer` updates every element on its own, as it must to step on shards.

    A probe: three steps on a 4 x 6 tensor, and the same steps on its four quadrants as four
    parameters, must agree. AdamW, SGD and the other per-element rules do; Adafactor (row and column
    means), LAMB-style trust ratios (norms) and anything else that reads the whole tensor do not, and
    would step differently on each shard than on the whole. Run before any collective, alike on
    every rank."""
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    grads = [torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
    quads = [(slice(r, r + 2), slice(c, c + 3)) for r in (0, 2) for c in (0, 3)]
    one = torch.nn.Parameter(whole.clone())
    parts = [torch.nn.Parameter(whole[q].clone()) for q in quads]
    try:
        opts = [optimizer([one], **options), optimizer(parts, **options)]
        for g in grads:
            one.grad = g.clone()
            for p, q in zip(parts, quads):
                p.grad = g[q].clone()
            for opt in opts:
                opt.step()
    except Exception as exc:  # noqa: BLE001  (the user's optimizer: any failure is reported as it is)
        agree = f"its step failed on a probe ({type(exc).__name__}: {exc})"
    else:
        rebuilt = torch.cat([torch.cat(parts[:2], 1), torch.cat(parts[2:], 1)], 0)
        if torch.allclose(rebuilt, one, rtol=1e-9, atol=1e-12):
            return
        agree = "it does not update each element on its own (a step on a tensor's pieces differs from a step on it)"
    names = ", ".join(split[:3]) + (f" and {len(split) - 3} more" if len(split) > 3 else "")
    raise ValueError(
        f"{optimizer.__module__}.{optimizer.__qualname__} cannot step on this plan's shards: {agree}, and each rank "
        f"holds pieces of {len(split)} parameters ({names}: split by the mesh's axes or by ZeRO). Fix: use an "
        "elementwise optimizer (AdamW, Adam, SGD, RMSprop, ...), or a plan whose parameters are whole on every rank "
        "(data parallelism with zero=0 and no tensor parallelism)"
    )


def _as_like(master: torch.Tensor, local_grad: torch.Tensor) -> torch.Tensor:
    if isinstance(master, DTensor):
        return DTensor.from_local(
            local_grad, master.device_mesh, master.placements, shape=master.shape, stride=master.stride()
        )
    return local_grad


def _master_dtype(t: torch.Tensor) -> torch.dtype:
    """Masters keep a full-precision parameter's own dtype (fp64 stays fp64), else fp32."""
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def _fp32_copy(p: torch.Tensor) -> torch.nn.Parameter:
    if isinstance(p.data, DTensor):
        d = p.data
        local = local_tensor(d).detach().to(_master_dtype(local_tensor(d))).clone()
        return torch.nn.Parameter(
            DTensor.from_local(local, d.device_mesh, d.placements, shape=d.shape, stride=d.stride())
        )
    return torch.nn.Parameter(p.detach().to(_master_dtype(p)).clone())


def _master_layout(layout, mesh_axes, data: tuple[str, ...], local_dim: int) -> tuple:
    """The parameter's layout with its data-parallel axes (`data`, in mesh order) splitting `local_dim` of
    the local shard, the first outermost.

    If other axes already split that dim, the data-parallel split is within
    their blocks: a strided shard whose groups are those blocks (over one data
    axis: `zero1_shard_dim` takes no such dim for several).
    """
    names = list(mesh_axes.names)
    out = list(layout)
    for axis in data:
        i = names.index(axis)
        groups = math.prod(
            n
            for j, (p, n) in enumerate(zip(layout, mesh_axes.sizes))
            if j > i and names[j] not in data and isinstance(p, pl.Shard) and p.dim == local_dim
        )
        out[i] = pl.Shard(local_dim, groups)
    return tuple(out)


class LossScaler:
    """Dynamic loss scaling (fp16): scale the loss, unscale the grads, skip a step on overflow."""

    def __init__(self, init_scale: float = 2.0**12, growth_interval: int = 2000, counter: CommCounter = COUNTER):
        # 2**12, not torch GradScaler's 2**16: here the parameters themselves are fp16, so the scaled
        # gradient entering the model must stay under fp16's 65504 from the first step
        self.scale, self.growth_interval, self.good_steps, self.counter = init_scale, growth_interval, 0, counter

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        found = torch.zeros(1)
        for g in grads:
            local = local_tensor(g)
            local.mul_(1.0 / self.scale)
            if not torch.isfinite(local).all():
                found.fill_(1.0)
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank skips together
            self.counter.record("optimizer", "all_reduce", "world", 4, "loss scaler")
        if found.item():
            self.scale /= 2.0
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return True


class MeshAdamW(MeshOptimizer):
    """`MeshOptimizer` with torch's AdamW, the default."""

    def __init__(self, params: dict[str, torch.nn.Parameter], **kwargs):
        super().__init__(params, torch.optim.AdamW, **kwargs)
