"""Weights in a file: a Hugging Face checkpoint (safetensors) or a DCP one, read into shards, and written back.

In: `open_weights(path)` takes a `.safetensors` file, a directory of sharded ones
with their `model.safetensors.index.json` (the Hugging Face layout), or a DCP
checkpoint directory (meshlib's own, or any whose keys are the model's FQNs).
`check` matches its tensors to the model's parameters by name (a tied parameter
under any of its names; a checkpoint of the model's base, without or with
`base_model_prefix`), and raises once, naming every missing, unexpected or
mis-shaped tensor, before anything is read. Each rank then reads only the
slices it holds: safetensors reads a slice without the rest of its tensor, so a
rank's peak is its own shards plus one block of one tensor. A fused projection
(GPT-2's `c_attn`, split in groups) is read as one block per run of rows it
holds. A DCP checkpoint is read by DCP itself, into the DTensor shards.

Out: `export(par, path)` writes the trained model back under its own names as
consolidated safetensors files (several, with the index, past `max_shard_size`)
that `transformers`' `from_pretrained` reads. Each tensor is gathered whole on
the ranks that hold it and written by one of them, one file at a time: no rank
ever holds more than one file's worth of the model.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re

import torch
import torch.distributed as dist

INDEX = "model.safetensors.index.json"


class SafetensorsWeights:
    """Tensors of one or several safetensors files, by key: their shapes from the headers."""

    kind = "safetensors"

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path, self._open = path, safe_open
        self.files = _files(path)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.where: dict[str, str] = {}
        self.stacks: dict = {}  # a parameter stacked from per-expert tensors -> its `stacked.Stack`
        for file in sorted(set(self.files.values())) if self.files else []:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())
                    self.where[key] = file

    def read(self, key: str, index: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The elements at the product of `index` (per dim, sorted global indices), in `dtype`: one
        read per block of contiguous runs, never the whole tensor (of a stack, only its experts in `index`)."""
        if key in self.stacks:
            return self.stacks[key].read(self.read, index, dtype)
        runs = [_runs(ix.tolist()) for ix in index]
        out = torch.empty(tuple(len(ix) for ix in index), dtype=dtype)
        with self._open(self.where[key], framework="pt", device="cpu") as f:
            piece = f.get_slice(key)
            for block in itertools.product(*runs):
                src = tuple(slice(a, b) for (a, b, _) in block)
                dst = tuple(slice(at, at + b - a) for (a, b, at) in block)
                out[dst] = piece[src].to(dtype) if src else piece[:].to(dtype)
        return out

    def whole(self, key: str) -> torch.Tensor:
        if key in self.stacks:
            return self.read(key, [torch.arange(n) for n in self.shapes[key]], self._dtype(key))
        with self._open(self.where[key], framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    def _dtype(self, key: str) -> torch.dtype:
        """A stack's dtype: its first piece's, from the file's header."""
        first = self.stacks[key].parts[0][0]
        with self._open(self.where[first], framework="pt", device="cpu") as f:
            code = f.get_slice(first).get_dtype()
        return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[code]

    def add_stacks(self, stacks: dict) -> None:
        """Serve each parameter of `stacks` (name -> `stacked.Stack`) as a key of its stacked shape."""
        for name, stack in stacks.items():
            self.stacks[name] = stack
            first = self.shapes[stack.parts[0][0]]
            self.shapes[name] = (len(stack.parts[0]), sum(stack.rows), first[1])


class DCPWeights:
    """The model's tensors in a DCP checkpoint (`model.<fqn>`, as meshlib saves them, or plain `<fqn>`)."""

    kind = "dcp"

    def __init__(self, path: str):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        self.shapes = {k: tuple(md.size) for k, md in meta.items() if isinstance(md, TensorStorageMetadata)}
        if any(k.startswith("model.") for k in self.shapes):  # meshlib's layout: the rest is the optimizer's
            self.shapes = {k: s for k, s in self.shapes.items() if k.startswith("model.")}

    def load(self, tensors: dict[str, torch.Tensor], orders: dict | None = None) -> None:
        """Read every tensor (key -> this rank's DTensor or tensor) in place (a collective). A DTensor is read
        as the boxes of the model's indices it holds, as `checkpoint` saves it (`orders`, by key: the
        rank order of one held in unequal parts); DCP's own reading of a strided shard takes wrong rows."""
        import torch.distributed.checkpoint as dcp

        from .checkpoint import checkpointable

        orders = orders or {}
        views = {key: checkpointable(t, orders.get(key)) for key, t in tensors.items()}
        planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        dcp.load(views, storage_reader=dcp.FileSystemReader(self.path), planner=planner)


def open_weights(path) -> SafetensorsWeights | DCPWeights:
    """The weights at `path` (see the module docstring); `FileNotFoundError` if there are none."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")):
        return DCPWeights(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights={path!r}: no such file or directory")
    weights = SafetensorsWeights(path)
    if not weights.shapes:
        raise FileNotFoundError(
            f"weights={path!r} holds no safetensors files (nor a DCP checkpoint's .metadata). Fix: point it at a "
            f".safetensors file, a directory saved by save_pretrained, or a DCP checkpoint"
        )
    return weights


def _files(path: str) -> dict[str, str]:
    """key or file -> file: the index's weight map, or every .safetensors file there."""
    if os.path.isfile(path):
        return {path: path}
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return {f: os.path.join(path, f) for f in found}


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs `(start, stop, position in the list)` of sorted indices."""
    out, start, at = [], None, 0
    for i, x in enumerate(indices):
        if start is None:
            start, at = x, i
        elif x != indices[i - 1] + 1:
            out.append((start, indices[i - 1] + 1, at))
            start, at = x, i
    if start is not None:
        out.append((start, indices[-1] + 1, at))
    return out


def match(weights, model, params: dict, buffers: dict, aliases: dict) -> tuple[dict[str, str], dict[str, str]]:
    """`(parameter -> key, buffer -> key)`: each of `params` and `buffers` (name -> tensor, of `model`)
    found in `weights`, a tied parameter under any of its names (`aliases`: name -> the name in
    `params`). Raises once, naming every missing, unexpected and mis-shaped tensor, before anything
    is read."""
    keys = set(weights.shapes)
    strip = "model." if weights.kind == "dcp" and any(k.startswith("model.") for k in keys) else ""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names_of: dict[str, list[str]] = {}
    for alias, canon in aliases.items():
        names_of.setdefault(canon, []).append(alias)
    from .stacked import expert_stacks, file_names, renames

    renamings = renames(model)  # a module path the checkpoint names otherwise (transformers' mapping)
    also = lambda names: [f for n in names for f in file_names(n, renamings)]  # noqa: E731
    found, found_buffers, missing, wrong, seen = {}, {}, [], [], set()
    for name, p in params.items():
        key = _find(also(names_of.get(name, [name])), keys, strip, prefix)
        seen.add(key)
        if key is None:
            missing.append(name)
        elif weights.shapes[key] != tuple(p.shape):
            wrong.append(f"{key} is {weights.shapes[key]}, the model's {name} {tuple(p.shape)}")
        else:
            found[name] = key
    if missing and weights.kind == "safetensors":  # experts saved one tensor per expert (transformers' own format)
        stacks = expert_stacks(
            model, {n: tuple(params[n].shape) for n in missing}, weights.shapes,
            lambda names: _find(names, keys, strip, prefix),
        )  # fmt: skip
        weights.add_stacks(stacks)
        seen |= {k for stack in stacks.values() for part in stack.parts for k in part}
        found |= {n: n for n in stacks}
        missing = [n for n in missing if n not in stacks]
    for name, b in buffers.items():
        key = _find(also([name]), keys, strip, prefix)
        if key is not None and weights.shapes[key] == tuple(b.shape):
            found_buffers[name] = key
    for name, _ in model.named_buffers(remove_duplicate=False):  # saved buffers the program does not read
        seen.add(_find(also([name]), keys, strip, prefix))
    ignore = [re.compile(r) for r in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(k for k in keys - seen if not any(r.search(k) for r in ignore))
    if missing or unexpected or wrong:
        parts = [f"missing {_some(missing)}"] if missing else []
        parts += [f"unexpected {_some(unexpected)}"] if unexpected else []
        parts += [f"mis-shaped {_some(wrong)}"] if wrong else []
        raise ValueError(
            f"weights={weights.path!r} do not fit this model: {'; '.join(parts)}. Fix: load the checkpoint of this "
            "model (its names and shapes), or build the model from the checkpoint's config"
        )
    return found, found_buffers


def load_into(model: torch.nn.Module, path) -> None:
    """One process: read the checkpoint at `path` (as `open_weights` takes it) into the parameters and the
    buffers it holds of `model`, a model with values (its own init fills the buffers the checkpoint lacks),
    in their dtypes."""
    weights = open_weights(path)
    params = dict(model.named_parameters())
    first = {id(p): n for n, p in params.items()}
    aliases = {alias: first[id(p)] for alias, p in model.named_parameters(remove_duplicate=False)}
    buffers = dict(model.named_buffers())
    keys, buffer_keys = match(weights, model, params, buffers, aliases)
    tensors = {keys[n]: params[n] for n in keys} | {buffer_keys[n]: buffers[n] for n in buffer_keys}
    with torch.no_grad():
        if weights.kind == "dcp":
            weights.load(tensors)  # with no process group: DCP reads in this process
        else:
            for key, t in tensors.items():
                t.copy_(weights.whole(key))


def _find(names: list[str], keys: set[str], strip: str, prefix: str) -> str | None:
    for name in names:
        for key in (strip + name, name.removeprefix(prefix + ".") if prefix else name, f"{prefix}.{name}"):
            if key in keys:
                return key
    return None


def _some(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# -- out -----------------------------------------------------------------------------------------
def export(par, path, *, config=None, max_shard_size: int = 5 * 2**30) -> None:
    """Write the model as consolidated Hugging Face safetensors under its own names (every rank calls it).

    `config` (a `transformers` config, or anything with `save_pretrained`) is written beside it, so
    that `AutoModel...from_pretrained(path)` loads the result. Parameters are written in the dtype
    they train in; a tied parameter once, under its first name. Each file is written by one rank
    that holds all of its tensors (with a pipeline, a rank of their stage), gathered whole one at a
    time."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    params = par.named_model_parameters()
    meta = par.compiled.traced.params
    nbytes = {n: math.prod(p.shape) * torch.empty((), dtype=p.dtype).element_size() for n, p in meta.items()}
    files = _files_by_writer(_writers(list(meta), set(params)), nbytes, max_shard_size)
    weight_map = {}
    for k, (writer, group) in enumerate(files):
        name = "model.safetensors" if len(files) == 1 else f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        held = {}
        for n in group:
            weight_map[n] = name
            if n in params:
                whole = par.whole(n, params[n])  # a collective over the ranks that hold it
                if dist.get_rank() == writer:
                    held[n] = whole.detach().to("cpu").contiguous()
        if dist.get_rank() == writer:
            save_file(held, os.path.join(path, name), metadata={"format": "pt"})
    if dist.get_rank() == 0:
        if len(files) > 1:
            with open(os.path.join(path, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, f, indent=2)
        if config is not None:
            config.save_pretrained(path)
    dist.barrier()


def _writers(names: list[str], mine: set[str]) -> dict[str, int]:
    """Parameter -> the lowest rank that holds it (every rank learns every rank's parameters)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    holders = [set(x) for x in everyone]
    return {n: min(r for r, held in enumerate(holders) if n in held) for n in names}


def _files_by_writer(writer: dict[str, int], nbytes: dict[str, int], limit: int) -> list[tuple[int, list[str]]]:
    """`(writer, names)` per file: each writer's tensors, in model order, in files of at most `limit`
    bytes (a larger tensor gets a file of its own)."""
    files: list[tuple[int, list[str]]] = []
    for rank in sorted(set(writer.values())):
        size = 0
        for n in (n for n in writer if writer[n] == rank):
            if not files or files[-1][0] != rank or (files[-1][1] and size + nbytes[n] > limit):
                files.append((rank, []))
                size = 0
            files[-1][1].append(n)
            size += nbytes[n]
    return files


__all__ = ["DCPWeights", "SafetensorsWeights", "export", "load_into", "match", "open_weights"]
