"""Spec trees beside param trees, with optree.

Any pytree works: a torch-style flat dict of dotted names, nested dicts, lists,
tuples, namedtuples, a JAX/Flax params tree. Leaf order equals
`jax.tree_util`'s (dict keys sorted, `None` an empty subtree) and each leaf is
named by a dotted path: `{"layers": [{"w": x}]}` names `x` `layers.0.w`.

Example:
    >>> params = {"embed": ShapeDtype((16, 8)), "out": {"w": ShapeDtype((8, 16))}}
    >>> [path for path, _ in flatten_with_paths(params)[0]]
    ['embed', 'out.w']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree

from .mesh import Mesh
from .sharding import NamedSharding
from .spec import P

__all__ = [
    "ShapeDtype",
    "leaf_shape",
    "leaf_dtype",
    "itemsize",
    "flatten_with_paths",
    "flatten_dotted",
    "unflatten_dotted",
    "tree_shardings",
]

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}  # fmt: skip


class ShapeDtype:
    """An abstract leaf: a shape and a dtype name (like `jax.ShapeDtypeStruct`)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Sequence[int], dtype: Any = "float32") -> None:
        shape = tuple(shape)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
            raise ValueError(f"ShapeDtype shape {shape} must hold non-negative ints")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype_name(dtype))

    def __setattr__(self, name, value):
        raise AttributeError("ShapeDtype is frozen")

    def __eq__(self, other):
        return isinstance(other, ShapeDtype) and (self.shape, self.dtype) == (other.shape, other.dtype)

    def __hash__(self):
        return hash((self.shape, self.dtype))

    def __reduce__(self):
        return (ShapeDtype, (self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"ShapeDtype({self.shape}, {self.dtype!r})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * itemsize(self.dtype)


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, numpy/jax float32, or the string itself."""
    name = str(getattr(dtype, "name", None) or dtype)
    return name.removeprefix("torch.")


def itemsize(dtype: Any) -> int:
    name = dtype_name(dtype)
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_ITEMSIZE)}") from None


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    shape = getattr(leaf, "shape", None)
    if shape is None:
        raise TypeError(f"leaf {type(leaf).__name__} has no .shape; rules need tensors or ShapeDtype leaves")
    return tuple(int(n) for n in shape)


def leaf_ndim(leaf: Any) -> int:
    return len(leaf_shape(leaf))


def leaf_dtype(leaf: Any) -> str:
    return dtype_name(getattr(leaf, "dtype", "float32"))


# -- paths ------------------------------------------------------------------------
def _entry_name(entry: Any) -> str:
    for attr in ("field", "name", "key"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry.entry)


def flatten_with_paths(tree: Any) -> tuple[list[tuple[str, Any]], optree.PyTreeSpec]:
    """`([(dotted path, leaf), ...], treespec)` in `jax.tree_util`'s leaf order."""
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(tree)
    paths = [".".join(_entry_name(e) for e in acc) for acc in accessors]
    return list(zip(paths, leaves)), treespec


def flatten_dotted(tree: Any) -> dict[str, Any]:
    """`{dotted path: leaf}` for any pytree, in leaf order."""
    pairs, _ = flatten_with_paths(tree)
    flat = dict(pairs)
    if len(flat) != len(pairs):
        seen: set[str] = set()
        dup = next(p for p, _ in pairs if p in seen or seen.add(p))
        raise ValueError(f"two leaves share the dotted path {dup!r}; rename one key")
    return flat


def unflatten_dotted(flat: Mapping[str, Any], like: Any = None) -> Any:
    """Rebuild a tree from `{dotted path: leaf}`.

    With `like`, the result has `like`'s structure (every path must be there);
    without it, nested dicts keyed by path segment.
    """
    if like is not None:
        pairs, treespec = flatten_with_paths(like)
        missing = [p for p, _ in pairs if p not in flat]
        extra = sorted(set(flat) - {p for p, _ in pairs})
        if missing or extra:
            raise ValueError(f"paths differ from the tree: missing {missing[:5]}, unexpected {extra[:5]}")
        return optree.tree_unflatten(treespec, [flat[p] for p, _ in pairs])
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        *parents, last = path.split(".")
        for seg in parents:
            node = node.setdefault(seg, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {path!r} runs through a leaf at {seg!r}")
        node[last] = leaf
    return out


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


# -- spec trees --------------------------------------------------------------------


def tree_shardings(tree: Any, specs: Any, mesh: Mesh, /, *, uneven: str = "error") -> Any:
    """A tree of `NamedSharding` for `tree`'s leaves, every shape checked on `mesh`."""
    pairs, treespec = flatten_with_paths(tree)
    spec_leaves = optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    if len(spec_leaves) != len(pairs):
        raise ValueError(f"spec tree has {len(spec_leaves)} leaves but the param tree has {len(pairs)}")
    out, errors = [], []
    for (path, leaf), spec in zip(pairs, spec_leaves):
        try:
            sharding = NamedSharding(mesh, spec, uneven=uneven)
            sharding.check(leaf_shape(leaf), path=path)
        except ValueError as err:
            msg = str(err)
            errors.append(msg if msg.startswith(path) else f"{path}: {msg}")
            continue
        out.append(sharding)
    if errors:
        raise ValueError(
            f"{plural(len(errors), 'spec', 'specs')} cannot be laid out on {mesh!r}:\n  " + "\n  ".join(errors)
        )
    return optree.tree_unflatten(treespec, out)
