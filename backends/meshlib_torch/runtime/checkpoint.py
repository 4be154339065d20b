"""Checkpoints of a whole training run with DCP, reloadable on any mesh and zero level.

`save(path, par, opt, step=...)` and `load(path, par, opt)` run on every rank.
One flat DCP state dict holds, keyed by each parameter's FQN in the original
model (not its path inside the split or FSDP-wrapped local graph):

    model.<fqn>              the parameter, in the run's parameter dtype
    optim.<fqn>.master       the fp32 master, only where MeshAdamW keeps one of another
                             dtype than the parameter (bf16/fp16 parameters, ZeRO-0/1)
    optim.<fqn>.exp_avg      AdamW's moments, in the dtype of the tensor AdamW updates
    optim.<fqn>.exp_avg_sq
    optim.<fqn>.step         AdamW's step count: a 0-d tensor, the same on every rank
    optim.scaler             [scale, good steps] of fp16 loss scaling (fp16 runs only)
    buffer.<fqn>             a buffer of the model's state dict (a router's balancing bias), whole
    rng.cpu                  (world size, n) uint8: every rank's CPU generator state;
                             on load rank r takes row r % (saved world size)
    step, extra              the caller's step and dict (pickled by DCP)

Every tensor is saved as it lives (a DTensor parameter in its layout, FSDP2's
shard, ZeRO-1's master shard), and DCP records each rank's piece by its global
offsets, so a run on another mesh or zero level reads just the pieces it needs.
Some pieces are not one box of the global tensor: a fused projection split in
groups over `tp` (a `StridedShard`), or in unequal parts (a DTensor of its rows
in rank order, `runtime.dtensor`: its boxes are mapped back to the model's
rows), and FSDP2's or ZeRO-1's split inside either. DTensor describes such a
piece by its first offset alone, so DCP refuses to save it (overlapping
chunks) and silently loads the wrong rows into it (both seen on torch 2.13).
Here each such piece is described as several boxes, one per contiguous run of
global indices along each dim (`_Pieces`), so no layout is converted or
gathered at save time, ZeRO-1's strided master shards included.

Where the full-precision value of a parameter comes from on load: its
`optim.<fqn>.master` if saved, else `model.<fqn>`. A run that keeps separate
masters loads its parameters from `model.<fqn>` (which equals the master
rounded) and its masters from the full-precision value; any other run loads
its parameters from the full-precision value. So checkpoints move between
precisions and between ZeRO-0/1 (masters in MeshAdamW) and ZeRO-2/3 (FSDP2's
fp32 shards are the masters).

A load is all or nothing. The checkpoint's metadata is checked first against
this run (missing or unexpected parameters, shapes, truncated data files),
every rank agrees on the outcome before the first DCP collective, and the
tensors are read into fresh buffers; only once everything has been read is
it copied into the model and installed as the optimizer's state. A bad
checkpoint raises `FileNotFoundError` or `ValueError` on every rank and
leaves the run as it was. DCP's own `CheckpointException` (a BaseException)
is caught and re-raised as one of those. The price: while it reads, a load
holds a second copy of this rank's model and optimizer state. A save writes
to `<path>.saving` and renames it into place once complete, so a save that
dies leaves the previous checkpoint whole; it replaces only a checkpoint.

`torch.distributed.checkpoint.state_dict.get_state_dict` does not fit: the
parameters sit under split and FSDP-wrapped submodules with other FQNs, and
MeshAdamW's AdamW updates masters and ZeRO-1 shards, not the model's
parameters.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

from ..torch_private import StridedShard, local_tensor, make_wrapper_subclass, shard_size_and_offsets

__all__ = ["checkpointable", "load", "rank_orders", "save"]

_LIST = 10  # names shown in an error before "... and N more"


# -- save ----------------------------------------------------------------------------------------
def save(path: str | os.PathLike, par, opt, *, step: int, extra: dict | None = None) -> None:
    """Write the model, optimizer, `step`, `extra` and RNG state to the directory `path` (every rank).

    The checkpoint is written beside `path` and moved into place once complete,
    so a save that dies midway leaves any earlier checkpoint at `path` whole.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"save(step=...) takes a non-negative int; got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save(extra=...) takes a dict or None; got {type(extra).__name__}")
    final = os.path.abspath(os.fspath(path))
    staging = final + ".saving"
    state: dict = _agreed(_live, par, opt)
    orders = rank_orders(par)
    state = {key: checkpointable(t, orders.get(_param_of(key))) for key, t in state.items()}
    _agreed(_on_rank0, _clear_staging, final, staging)
    state["rng.cpu"] = _gather_rng()
    state["step"], state["extra"] = step, dict(extra or {})
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), planner=planner)
    except CheckpointException as exc:
        raise OSError(f"could not save the checkpoint to {final}: {_causes(exc)}") from None
    _agreed(_on_rank0, _move_into_place, staging, final)


def _on_rank0(fn, *args) -> None:
    if dist.get_rank() == 0:
        fn(*args)


def _clear_staging(final: str, staging: str) -> None:
    if os.path.exists(final) and not os.path.isfile(os.path.join(final, ".metadata")):
        raise FileExistsError(f"{final} exists and is not a checkpoint: save() replaces only a checkpoint")
    shutil.rmtree(staging, ignore_errors=True)  # left by a save that died


def _move_into_place(staging: str, final: str) -> None:
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _live(par, opt) -> dict[str, torch.Tensor]:
    """The run's tensors by checkpoint key (see the module docstring)."""
    params = par.named_model_parameters()
    if set(params) != set(opt.params):
        raise ValueError("the optimizer is not this model's: build it with par.optimizer(...)")
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        out[f"model.{name}"] = p
        master = opt.master.get(name)
        if master is not None and master.dtype != p.dtype:
            out[f"optim.{name}.master"] = master
        for key, value in opt.inner.state.get(_target(opt, name), {}).items():
            if torch.is_tensor(value):
                out[f"optim.{name}.{key}"] = value
    if opt.scaler is not None:
        out["optim.scaler"] = torch.tensor([opt.scaler.scale, opt.scaler.good_steps], dtype=torch.float64)
    for name, b in _persistent(par).items():
        out[f"buffer.{name}"] = b
    return out


def _persistent(par) -> dict[str, torch.Tensor]:
    """This rank's buffers that the model's state dict holds, by FQN."""
    return {n: b for n, b in par.named_model_buffers().items() if n in par.compiled.persistent}


def rank_orders(par) -> dict[str, dict[int, torch.Tensor]]:
    """The parameters held in unequal parts, each with the model's row of each of its DTensor's rows
    (which are in rank order: `runtime.dtensor`); the same for their gradients, masters and moments."""
    orders = {name: par.compiled.param_rank_order(name) for name in par.compiled.traced.params}
    return {name: order for name, order in orders.items() if order}


def _param_of(key: str) -> str:
    """The parameter FQN a checkpoint key belongs to (`model.<fqn>`, `optim.<fqn>.<state>`)."""
    if key.startswith("model."):
        return key.removeprefix("model.")
    return key.removeprefix("optim.").rsplit(".", 1)[0] if key.startswith("optim.") else ""


def _target(opt, name: str) -> torch.Tensor:
    """The tensor AdamW updates for parameter `name`: its master if it has one, else itself."""
    master = opt.master.get(name)
    return master if master is not None else opt.params[name]


def _gather_rng() -> torch.Tensor:
    mine = torch.get_rng_state()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


# -- load ----------------------------------------------------------------------------------------
@dataclass
class _Slot:
    """One tensor to read: checkpoint `key` into a fresh buffer made like `like`."""

    key: str
    like: torch.Tensor
    role: str  # "param", "master", "buffer" or an optimizer state name
    name: str = ""  # the parameter FQN


def load(path: str | os.PathLike, par, opt) -> dict:
    """Restore the run saved at `path` (every rank); returns {"step": int, "extra": dict}.

    Raises `FileNotFoundError` or `ValueError`, on every rank alike, for a
    checkpoint that is missing, unreadable or of another model, and then
    leaves the model and optimizer untouched.
    """
    path = os.fspath(path)
    slots = _agreed(_plan, path, par, opt)
    buffers = {id(s): _empty_like(s.like) for s in slots}
    loaded = _read(path, slots, buffers, rank_orders(par))
    with torch.no_grad():
        _commit(par, opt, slots, buffers)
    rows = loaded["rng.cpu"]
    torch.set_rng_state(rows[dist.get_rank() % rows.shape[0]].clone())
    if opt.scaler is not None and "optim.scaler" in loaded:
        scale, good = loaded["optim.scaler"].tolist()
        opt.scaler.scale, opt.scaler.good_steps = scale, int(good)
    return {"step": loaded["step"], "extra": loaded["extra"]}


def _plan(path: str, par, opt) -> list[_Slot]:
    """What to read into what, after checking the checkpoint's metadata against this run."""
    meta = _metadata(path)
    saved = meta.state_dict_metadata
    params = par.named_model_parameters()
    if set(params) != set(opt.params):
        raise ValueError("the optimizer is not this model's: build it with par.optimizer(...)")
    for key in ("step", "extra", "rng.cpu"):
        if key not in saved:
            raise ValueError(f"{path} is not a meshlib checkpoint: it has no {key!r} entry")
    _check_names(path, saved, set(par.compiled.traced.params))  # the whole model's: a pipeline rank holds a part
    stated = _by_param(saved)
    slots = []
    for name, p in params.items():
        slots += _param_slots(name, p, opt, saved)
        slots += _state_slots(name, opt, stated)
    for name, b in _persistent(par).items():
        if f"buffer.{name}" not in saved:
            raise ValueError(f"checkpoint {path} has no buffer {name!r}, which this model keeps in its state dict")
        slots.append(_Slot(f"buffer.{name}", b, "buffer", name))
    slots.append(_Slot("rng.cpu", torch.empty(saved["rng.cpu"].size, dtype=torch.uint8), "rng"))
    if "optim.scaler" in saved:
        slots.append(_Slot("optim.scaler", torch.empty(2, dtype=torch.float64), "scaler"))
    _check_shapes(path, saved, slots)
    _check_files(path, meta)
    return slots


def _param_slots(name: str, p, opt, saved) -> list[_Slot]:
    master = opt.master.get(name)
    full = f"optim.{name}.master" if f"optim.{name}.master" in saved else f"model.{name}"
    separate = master is not None and master.dtype != p.dtype
    out = [_Slot(f"model.{name}" if separate else full, p, "param", name)]
    if master is not None:
        out.append(_Slot(full, master, "master", name))
    return out


def _state_slots(name: str, opt, stated: dict) -> list[_Slot]:
    """AdamW's state for `name` as the checkpoint has it (none: saved before the first step)."""
    target = _target(opt, name)
    live = opt.inner.state.get(target, {})
    out = []
    for state, md in stated.get(name, {}).items():
        key = f"optim.{name}.{state}"
        if len(md.size) == 0:  # a scalar such as the step count, the same on every rank
            dtype = live[state].dtype if state in live else md.properties.dtype
            out.append(_Slot(key, torch.empty((), dtype=dtype), state, name))
        else:
            out.append(_Slot(key, live[state] if state in live else target, state, name))
    return out


def _by_param(saved) -> dict[str, dict]:
    """The checkpoint's optimizer state entries (not masters) by parameter FQN, then by state name."""
    out: dict[str, dict] = defaultdict(dict)
    for key, md in saved.items():
        if key.startswith("optim.") and key != "optim.scaler":
            name, state = key.removeprefix("optim.").rsplit(".", 1)
            if state != "master":
                out[name][state] = md
    return out


def _read(path: str, slots: list[_Slot], buffers: dict, orders: dict) -> dict:
    """DCP-load every slot (a key read into two buffers takes two rounds); the loaded values by key.
    `orders`: the rank order of the parameters held in unequal parts (`rank_orders`)."""
    rounds: list[dict] = [{"step": 0, "extra": {}}]
    out: dict = {}
    seen: dict[str, int] = defaultdict(int)
    for s in slots:
        i = seen[s.key]
        seen[s.key] += 1
        if i == len(rounds):
            rounds.append({})
        rounds[i][s.key] = checkpointable(buffers[id(s)], orders.get(s.name))
        out.setdefault(s.key, buffers[id(s)])
    planner = lambda: dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)  # noqa: E731
    for state in rounds:
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=planner())
        except CheckpointException as exc:
            why = _causes(exc)
            raise ValueError(
                f"checkpoint {path} could not be read (a corrupt data file?), so nothing was loaded: {why}"
            ) from None
    out["step"], out["extra"] = rounds[0]["step"], rounds[0]["extra"]
    return out


def _commit(par, opt, slots: list[_Slot], buffers: dict) -> None:
    """Copy the loaded parameters and masters in place; install the loaded optimizer state."""
    state: dict[str, dict] = defaultdict(dict)
    for s in slots:
        buf = buffers[id(s)]
        if s.role in ("param", "master", "buffer"):
            local_tensor(s.like.data).copy_(local_tensor(buf))
        elif s.name:
            state[s.name][s.role] = buf
    for name in opt.params:
        target = _target(opt, name)
        if name in state:
            opt.inner.state[target] = state[name]
        else:
            opt.inner.state.pop(target, None)


# -- checks (before any collective) --------------------------------------------------------------
def _agreed(fn, *args):
    """`fn(*args)` on every rank; if it raised on any, raise the first failure on every rank.

    The gather doubles as a barrier: DCP's collectives start only once every
    rank has passed its checks.
    """
    result, mine = None, None
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others hang in DCP
        mine = (type(exc).__name__, str(exc))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [(rank, e) for rank, e in enumerate(everyone) if e is not None]
    if failed:
        rank, (kind, msg) = failed[0]
        cls = _ERRORS.get(kind)
        raise cls(msg) if cls else RuntimeError(f"rank {rank} raised {kind}: {msg}")
    return result


_ERRORS = {e.__name__: e for e in (ValueError, TypeError, FileNotFoundError, FileExistsError, OSError)}


def _metadata(path: str):
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"no checkpoint at {path}: it has no .metadata file (an unfinished save?)")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unpickling error means the same thing
        raise ValueError(f"checkpoint {path} has an unreadable .metadata file ({type(exc).__name__}: {exc})") from None


def _check_names(path: str, saved, params) -> None:
    have = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    stated = {k.removeprefix("optim.").rsplit(".", 1)[0] for k in saved if k.startswith("optim.")} - {"scaler"}
    missing, unexpected = sorted(set(params) - have), sorted((have | stated) - set(params))
    if missing or unexpected:
        parts = [f"missing parameters {_names(missing)}"] if missing else []
        parts += [f"unexpected parameters {_names(unexpected)}"] if unexpected else []
        raise ValueError(f"checkpoint {path} is of another model: {'; '.join(parts)}")


def _check_shapes(path: str, saved, slots: list[_Slot]) -> None:
    wrong = {}
    for s in slots:
        md = saved[s.key]
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"checkpoint {path}: {s.key} is not a tensor there")
        if s.role != "rng" and tuple(md.size) != tuple(s.like.shape):
            wrong.setdefault(s.name or s.key, f"{s.key} saved {tuple(md.size)}, this run {tuple(s.like.shape)}")
    if wrong:
        lines = list(wrong.values())
        raise ValueError(f"checkpoint {path} has other shapes than this model: {_names(lines)}")


def _check_files(path: str, meta) -> None:
    """Every data file the metadata points into exists and is long enough (a truncated copy is not)."""
    need: dict[str, int] = defaultdict(int)
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need[info.relative_path], info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint {path} is incomplete: its data file {name} is missing")
        if (got := os.path.getsize(file)) < size:
            raise ValueError(f"checkpoint {path} is truncated: {name} has {got} bytes, its metadata needs {size}")


def _names(items: list[str]) -> str:
    more = f" ... and {len(items) - _LIST} more" if len(items) > _LIST else ""
    return ", ".join(items[:_LIST]) + more


def _causes(exc: CheckpointException) -> str:
    """What DCP raised, with the ranks it raised on."""
    by_cause: dict[str, list[int]] = defaultdict(list)
    for rank, (e, _) in sorted(exc.failures.items()):
        by_cause[f"{type(e).__name__}: {e}"].append(rank)
    return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {cause}" for cause, r in by_cause.items())


# -- the pieces DCP sees ------------------------------------------------------------------------
def _empty_like(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        local = torch.empty_like(local_tensor(t))
        return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)
    return torch.empty_like(t)


def checkpointable(t: torch.Tensor, order: dict | None = None) -> torch.Tensor:
    """What DCP saves from or loads into: a plain tensor as it is; a DTensor as the boxes this rank holds,
    in the model's indices (`order`: for a parameter held in unequal parts, the model's row of each of
    the DTensor's rows, which are in rank order)."""
    if not isinstance(t, DTensor):
        return t.detach()
    local = local_tensor(t).detach()
    runs = _held_runs(t, order or {})
    boxes = []
    if runs is not None:
        for combo in itertools.product(*runs):
            view = local
            for d, (start, _, length) in enumerate(combo):
                view = view.narrow(d, start, length)
            boxes.append((torch.Size(g for _, g, _ in combo), view))
    return _Pieces(t.shape, local, boxes)


def _held_runs(t: DTensor, order: dict) -> list[list[tuple[int, int, int]]] | None:
    """Per tensor dim, the (local start, global start, length) runs this rank holds; None if nothing.

    The global indices come from DTensor's own rule (placements applied left to
    right over the mesh, `StridedShard` included), kept whole rather than
    reduced to their first offset; along a dim of `order` they index rows in
    rank order, which `order` turns into the model's rows.
    """
    mesh, shape = t.device_mesh, tuple(t.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    sizes, index = list(shape), {}
    for mesh_dim, p in enumerate(t.placements):
        if not isinstance(p, (Shard, StridedShard)):
            continue
        size, offsets = shard_size_and_offsets(
            sizes[p.dim], mesh.size(mesh_dim), coord[mesh_dim], p, index.get(p.dim), shape[p.dim], False
        )
        if size == 0:
            return None
        sizes[p.dim], index[p.dim] = size, offsets
    if tuple(sizes) != tuple(local_tensor(t).shape):
        raise ValueError(f"a DTensor's local shape {tuple(local_tensor(t).shape)} is not its layout's {tuple(sizes)}")
    held = [index.get(d, torch.arange(n)) for d, n in enumerate(shape)]
    held = [order[d][ix] if d in order else ix for d, ix in enumerate(held)]
    return [_runs(ix.tolist()) for ix in held]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    out: list[list[int]] = []
    for i, g in enumerate(indices):
        if out and g == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([i, g, 1])
    return [tuple(r) for r in out]


class _Pieces(torch.Tensor):
    """A global tensor as the boxes of it this rank holds, each a view into the local tensor.

    It implements DCP's checkpointable protocol (`__create_write_items__`,
    `__create_chunk_list__`, `__get_tensor_shard__`) and nothing else: no op runs on it.
    """

    @staticmethod
    def __new__(cls, shape, local: torch.Tensor, boxes: list):
        r = make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        r._boxes = boxes
        r._properties = TensorProperties.create_from_tensor(local)
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"{func} is not supported on a checkpoint's view of a tensor")

    def _chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.shape) for offsets, view in self._boxes]

    def __create_write_items__(self, fqn: str, object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=self._properties, size=self.shape),
            )
            for chunk in self._chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self._boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no piece at offset {tuple(index.offset or ())}")

    def __repr__(self) -> str:
        return f"_Pieces(shape={tuple(self.shape)}, boxes={len(self._boxes)})"
