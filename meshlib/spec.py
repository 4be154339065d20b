"""`P`, the partition spec: how each dim of a tensor maps onto mesh axes.

It follows `jax.sharding.PartitionSpec`: each entry is `None` (the dim is
replicated), an axis name, or a tuple of axis names (the dim is split over
all of them, the first one major). `unreduced` names the mesh axes over which
the value is a partial sum (JAX's `unreduced`, DTensor's `Partial`).

Example:
    >>> P("dp", None)
    P('dp', None)
    >>> P(("dp", "tp"), unreduced={"cp"}).axes
    ('dp', 'tp', 'cp')
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["P", "UNCONSTRAINED"]


class _Unconstrained:
    """Sentinel entry: the compiler may choose this dim's layout."""

    __slots__ = ()
    _instance: _Unconstrained | None = None

    def __new__(cls) -> _Unconstrained:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCONSTRAINED"

    def __reduce__(self):
        return (_Unconstrained, ())


UNCONSTRAINED = _Unconstrained()

# Not an identifier, so it can never collide with a mesh axis name.
_JSON_UNCONSTRAINED = "?"

Entry = None | str | tuple[str, ...] | _Unconstrained


def _entry(value: object, index: int) -> Entry:
    if value is None or value is UNCONSTRAINED:
        return value
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)):
        names = tuple(value)
        if not names:
            return None
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(
                f"P entry {index} is {value!r}: a tuple entry holds mesh axis names "
                f"(str), got {bad!r}"
            )
        return names[0] if len(names) == 1 else names
    raise TypeError(
        f"P entry {index} is {value!r} of type {type(value).__name__}: an entry is None, "
        "an axis name, a tuple of axis names, or P.UNCONSTRAINED"
    )


def entry_axes(entry: Entry) -> tuple[str, ...]:
    """The mesh axes one entry names, major first."""
    if entry is None or entry is UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


def _axis_set(value: Iterable[str] | str, what: str) -> frozenset[str]:
    names = (value,) if isinstance(value, str) else tuple(value)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"P {what}= holds mesh axis names (str), got {bad!r}")
    return frozenset(names)


class P:
    """A partition spec, frozen and hashable; see the module docstring."""

    __slots__ = ("_entries", "unreduced", "reduced")
    UNCONSTRAINED = UNCONSTRAINED

    def __init__(
        self,
        *entries: object,
        unreduced: Iterable[str] | str = frozenset(),
        reduced: Iterable[str] | str = frozenset(),
    ) -> None:
        parts = tuple(_entry(e, i) for i, e in enumerate(entries))
        unred = _axis_set(unreduced, "unreduced")
        red = _axis_set(reduced, "reduced")
        _set = object.__setattr__
        _set(self, "_entries", parts)
        _set(self, "unreduced", unred)
        _set(self, "reduced", red)
        self._validate()

    def _validate(self) -> None:
        seen: dict[str, int] = {}
        for i, entry in enumerate(self._entries):
            for axis in entry_axes(entry):
                if axis in seen:
                    raise ValueError(
                        f"{self!r} uses mesh axis {axis!r} twice (dims {seen[axis]} and {i}); "
                        "a mesh axis can shard at most one dim. Fix: drop it from one dim, "
                        f"or shard dim {i} over another axis"
                    )
                seen[axis] = i
        for what, axes in (("unreduced", self.unreduced), ("reduced", self.reduced)):
            both = sorted(axes & seen.keys())
            if both:
                raise ValueError(
                    f"{self!r}: axes {both} are both sharding a dim and {what}; "
                    f"an axis is either in a dim entry or in {what}=, not both"
                )
        if self.unreduced & self.reduced:
            raise ValueError(
                f"{self!r}: axes {sorted(self.unreduced & self.reduced)} are both "
                "unreduced and reduced"
            )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"P is frozen; build a new P instead of setting {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("P is frozen")

    # -- sequence protocol ------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __getitem__(self, index):
        return self._entries[index]

    # -- value semantics ----------------------------------------------------
    def _key(self):
        return (self._entries, self.unreduced, self.reduced)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, P):
            return self._key() == other._key()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):
        return (_rebuild, (self._entries, tuple(sorted(self.unreduced)), tuple(sorted(self.reduced))))

    def __repr__(self) -> str:
        parts = [repr(e) for e in self._entries]
        for what in ("unreduced", "reduced"):
            axes = getattr(self, what)
            if axes:
                parts.append(f"{what}={{{', '.join(repr(a) for a in sorted(axes))}}}")
        return f"P({', '.join(parts)})"

    # -- derived views ------------------------------------------------------
    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec names: dim entries in order, then unreduced."""
        named = tuple(a for e in self._entries for a in entry_axes(e))
        return named + tuple(sorted(self.unreduced))

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """The mesh axes that split a dim, in dim order."""
        return tuple(a for e in self._entries for a in entry_axes(e))

    @property
    def has_unconstrained(self) -> bool:
        return any(e is UNCONSTRAINED for e in self._entries)

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """Mesh axes that split `dim` (major first); () past the spec's end."""
        return entry_axes(self._entries[dim]) if dim < len(self._entries) else ()

    def padded(self, ndim: int) -> P:
        """This spec with trailing `None`s up to `ndim` entries."""
        extra = (None,) * max(0, ndim - len(self._entries))
        return P(*self._entries, *extra, unreduced=self.unreduced, reduced=self.reduced)

    def to_json(self) -> dict:
        entries = [list(e) if isinstance(e, tuple) else e for e in self._entries]
        entries = [_JSON_UNCONSTRAINED if e is UNCONSTRAINED else e for e in entries]
        out: dict = {"entries": entries}
        if self.unreduced:
            out["unreduced"] = sorted(self.unreduced)
        if self.reduced:
            out["reduced"] = sorted(self.reduced)
        return out

    @classmethod
    def from_json(cls, data: dict) -> P:
        entries = [UNCONSTRAINED if e == _JSON_UNCONSTRAINED else e for e in data["entries"]]
        return cls(*entries, unreduced=data.get("unreduced", ()), reduced=data.get("reduced", ()))


def _rebuild(entries, unreduced, reduced) -> P:
    return P(*entries, unreduced=unreduced, reduced=reduced)
