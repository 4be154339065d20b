"""Rules: pure functions `(path, leaf) -> P | None` that say how a tensor is laid out.

`path` is the dotted name of a leaf (`layers.3.attn.wq.weight`); `leaf` is the
tensor or any object with `.shape` and `.dtype`, so a rule may depend on both.
A rule returns `None` when the leaf is not its business; `compose` tries rules
in order and `apply_rules` raises for a leaf no rule claims.

- `pattern_rules`: a table of glob or regex patterns over dotted paths.
- `logical_rules`: Flax's logical axis rules (ordered; first unused mesh axis wins).
- `dims`: einops-style dim names such as `"batch seq embed"`, through logical rules.
- `compose`: first match wins.

Example:
    >>> logical = logical_rules({"batch": "dp", "heads": "tp", "embed": None})
    >>> rule = pattern_rules({"**.wq.weight": "heads embed", "**.norm.*": P()}, logical=logical)
    >>> rule("layers.0.wq.weight", ShapeDtype((8, 8), "float32"))
    P('tp', None)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optree
from einops import EinopsError
from einops.parsing import ParsedExpression

from .spec import P
from .tree import ShapeDtype, flatten_with_paths, leaf_ndim, leaf_shape, plural  # noqa: F401  (ShapeDtype: docstring example)

__all__ = ["Rule", "apply_rules", "pattern_rules", "logical_rules", "dims", "compose", "PatternRules", "LogicalRules"]

Rule = Callable[[str, Any], "P | None"]
_MISSING: Any = object()
MeshAxes = None | str | tuple[str, ...]


# -- glob patterns over dotted paths ---------------------------------------------------
def _glob_segment(seg: str) -> str:
    out, i = [], 0
    while i < len(seg):
        c = seg[i]
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif c == "[" and "]" in seg[i + 1 :]:
            j = seg.index("]", i + 1)
            body = seg[i + 1 : j]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append(f"[{body}]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _compile(pattern: str) -> re.Pattern:
    """Globs: `*` is one path segment (or part of one), `**` any number of segments.
    A pattern starting with `re:` is a regex matched against the whole path."""
    if pattern.startswith("re:"):
        return re.compile(f"(?:{pattern[3:]})\\Z")
    body = "".join("(?:\\.[^.]+)*" if seg == "**" else "\\." + _glob_segment(seg) for seg in pattern.split("."))
    return re.compile(body + "\\Z")


def _match(regex: re.Pattern, pattern: str, path: str) -> bool:
    return bool(regex.match(path if pattern.startswith("re:") else "." + path))


# -- logical axis rules (Flax semantics) ---------------------------------------------
def _flat_axes(value: MeshAxes) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


class LogicalRules:
    """Ordered `(logical name, mesh axes)` pairs with Flax's assignment semantics.

    Rules are visited in order; a rule assigns its mesh axes to the dim with
    that logical name if the dim has no assignment yet and none of the axes is
    used by another dim. Dims left unassigned are replicated.
    """

    __slots__ = ("rules", "strict")

    def __init__(
        self, rules: Mapping[str, MeshAxes] | Iterable[tuple[str, MeshAxes]], *, strict: bool = False
    ) -> None:
        pairs = tuple(rules.items() if isinstance(rules, Mapping) else rules)
        for pair in pairs:
            if len(pair) != 2 or not isinstance(pair[0], str):
                raise TypeError(f"a logical rule is (logical name, mesh axes); got {pair!r}")
            for axis in _flat_axes(pair[1]):
                if not isinstance(axis, str):
                    raise TypeError(f"logical rule {pair!r}: mesh axes are str, got {axis!r}")
        object.__setattr__(self, "rules", tuple((name, _normal(axes)) for name, axes in pairs))
        object.__setattr__(self, "strict", bool(strict))

    def __setattr__(self, name, value):
        raise AttributeError("LogicalRules is frozen")

    def __eq__(self, other):
        return isinstance(other, LogicalRules) and (self.rules, self.strict) == (other.rules, other.strict)

    def __hash__(self):
        return hash((self.rules, self.strict))

    def __repr__(self) -> str:
        return f"logical_rules({list(self.rules)!r}{', strict=True' if self.strict else ''})"

    def mesh_axes(self, names: Sequence[str | None]) -> list[MeshAxes]:
        """Flax's `logical_to_mesh_axes` for one tensor's logical dim names."""
        named = [n for n in names if n is not None]
        if self.strict:
            known = {name for name, _ in self.rules}
            unknown = [n for n in named if n not in known]
            if unknown:
                raise ValueError(
                    f"logical dim names {unknown} have no rule (strict=True); known names: "
                    f"{sorted(known)}. Fix: add a rule, e.g. {{{unknown[0]!r}: None}} to replicate"
                )
        dups = sorted({n for n in named if named.count(n) > 1})
        if dups:
            raise ValueError(f"logical dim names {dups} occur more than once in {tuple(names)}")
        unassigned = object()
        result: list[Any] = [unassigned if n is not None else None for n in names]
        for logical, axes in self.rules:
            if logical not in named:
                continue
            pos = names.index(logical)
            used = {a for r in result if r is not unassigned for a in _flat_axes(r)}
            if result[pos] is unassigned and not used & set(_flat_axes(axes)):
                result[pos] = axes
        return [None if r is unassigned else r for r in result]

    def spec(self, names: Sequence[str | None | tuple[str, ...]]) -> P:
        """P for logical dim names; a tuple entry is a merged dim, `(heads head_dim)`."""
        groups = [g if isinstance(g, tuple) else (g,) for g in names]
        flat = [n for g in groups for n in g if n is not None]
        assigned = dict(zip(flat, self.mesh_axes(flat)))
        entries = []
        for group in groups:
            axes = tuple(a for n in group if n is not None for a in _flat_axes(assigned[n]))
            entries.append(axes or None)
        return P(*entries)


def _normal(axes: MeshAxes) -> MeshAxes:
    if isinstance(axes, (list, tuple)):
        axes = tuple(axes)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return axes


def logical_rules(
    rules: Mapping[str, MeshAxes] | Iterable[tuple[str, MeshAxes]], /, *, strict: bool = False
) -> LogicalRules:
    """Flax-style logical axis rules, e.g. `{"batch": "dp", "heads": "tp", "embed": None}`.

    Names without a rule are replicated, as in Flax; `strict=True` raises for them
    instead, which catches a misspelt dim name.
    """
    if isinstance(rules, LogicalRules):
        return rules if not strict or rules.strict else LogicalRules(rules.rules, strict=True)
    return LogicalRules(rules, strict=strict)


# -- einops-style dim names ----------------------------------------------------------
def parse_dims(expr: str, ndim: int | None = None, *, path: str | None = None) -> list:
    """`"batch (heads hd) embed"` -> `['batch', ('heads', 'hd'), 'embed']`.

    `...` stands for leading or middle dims that stay replicated (needs `ndim`);
    `1` or `()` marks a replicated dim with no name.
    """
    try:
        return list(_parse_dims(expr, ndim))
    except ValueError as err:
        raise ValueError(f"{path}: {err}" if path else str(err)) from None


@functools.lru_cache(maxsize=1024)
def _parse_dims(expr: str, ndim: int | None) -> tuple:
    try:
        parsed = ParsedExpression(expr)
    except EinopsError as err:
        raise ValueError(f"dim names {expr!r} do not parse: {err}") from None
    out: list = []
    for group in parsed.composition:
        if group == "…":
            out.append(...)
        else:
            names = tuple(n for n in group if isinstance(n, str))
            out.append(None if not names else names[0] if len(names) == 1 else names)
    if ... in out:
        if ndim is None or ndim < len(out) - 1:
            raise ValueError(f"dim names {expr!r} need a tensor of at least {len(out) - 1} dims")
        at = out.index(...)
        out[at : at + 1] = [None] * (ndim - len(out) + 1)
    if ndim is not None and len(out) != ndim:
        raise ValueError(
            f"dim names {expr!r} name {len(out)} dims but the tensor has {ndim}. "
            "Fix: give one name per dim (use `1` for an unnamed dim or `...` for leading dims)"
        )
    return tuple(out)


def dims(expr: str, /, *, logical: LogicalRules | Mapping, ndim: int | None = None) -> P:
    """P for einops-style dim names resolved through logical rules.

    Example:
        >>> dims("batch seq embed", logical={"batch": "dp", "seq": "cp"})
        P('dp', 'cp', None)
    """
    return logical_rules(logical).spec(parse_dims(expr, ndim))


# -- pattern tables -------------------------------------------------------------------
class PatternRules:
    """A rule from a `{pattern: value}` table; see `pattern_rules`."""

    __slots__ = ("table", "logical", "default", "_compiled")

    def __init__(self, table, logical, default):
        _set = object.__setattr__
        _set(self, "table", tuple(table.items()))
        _set(self, "logical", None if logical is None else logical_rules(logical))
        _set(self, "default", default)
        _set(self, "_compiled", tuple((_compile(k), k, v) for k, v in self.table))
        named = [(pattern, value) for _, pattern, value in self._compiled]
        if default is not _MISSING:
            named.append(("default", default))
        for pattern, value in named:
            if isinstance(value, str) and self.logical is None:
                raise ValueError(
                    f"{pattern!r} maps to dim names {value!r}, which need logical "
                    "rules. Fix: pass logical={...}, or give a P"
                )

    def __setattr__(self, name, value):
        raise AttributeError("PatternRules is frozen")

    def __repr__(self) -> str:
        return f"pattern_rules({dict(self.table)!r})"

    def matches(self, path: str) -> list[str]:
        """Every pattern that matches `path`."""
        return [pattern for regex, pattern, _ in self._compiled if _match(regex, pattern, path)]

    def __call__(self, path: str, leaf: Any = None) -> P | None:
        hits = [(pattern, value) for regex, pattern, value in self._compiled if _match(regex, pattern, path)]
        if len(hits) > 1:
            raise ValueError(
                f"{path}: ambiguous, matched by patterns {hits[0][0]!r} and {hits[1][0]!r}"
                + (f" (and {len(hits) - 2} more)" if len(hits) > 2 else "")
                + ". Fix: narrow one pattern, or split the table and `compose` them in priority order"
            )
        if not hits:
            return None if self.default is _MISSING else _resolve(self.default, path, leaf, self.logical)
        return _resolve(hits[0][1], path, leaf, self.logical)


def _resolve(value: Any, path: str, leaf: Any, logical: LogicalRules | None) -> P | None:
    if value is None:
        return P()
    if isinstance(value, P):
        return value
    if isinstance(value, (tuple, list)):
        return P(*value)
    if isinstance(value, str):
        ndim = leaf_ndim(leaf) if leaf is not None else None
        return logical.spec(parse_dims(value, ndim, path=path))
    if callable(value):
        return value(path, leaf)
    raise TypeError(
        f"{path}: rule value {value!r} is not a P, a tuple, dim names (str), or a callable (path, leaf)"
    )


def pattern_rules(
    table: Mapping[str, Any],
    /,
    *,
    logical: LogicalRules | Mapping | None = None,
    default: Any = _MISSING,
) -> PatternRules:
    """A rule from a table of patterns over dotted paths.

    Keys are globs (`*` one segment or part of one, `**` any number of
    segments, `[qkv]` a character class) or, prefixed `re:`, regexes matched
    against the whole path. Values are a `P`, a tuple of entries, einops dim
    names (resolved through `logical`), a callable `(path, leaf) -> P`, or
    `None` for replicated. A path that two patterns match raises; a path no
    pattern matches gets `default`, or no answer (`None`) when there is none.
    """
    if not isinstance(table, Mapping):
        raise TypeError(f"pattern_rules takes a mapping of pattern -> spec, got {type(table).__name__}")
    return PatternRules(table, logical, default)


def compose(*rules: Rule, default: Any = _MISSING) -> Rule:
    """A rule that asks each rule in turn; the first answer that is not `None` wins."""
    if not rules:
        raise ValueError("compose needs at least one rule")
    if isinstance(default, str):
        raise TypeError(
            f"compose(default={default!r}): dim names need logical rules, which compose does not "
            "have. Fix: give a P, or put the names in a pattern_rules(..., logical=...) default"
        )

    def composed(path: str, leaf: Any = None) -> P | None:
        for rule in rules:
            spec = rule(path, leaf)
            if spec is not None:
                return spec
        return None if default is _MISSING else _resolve(default, path, leaf, None)

    composed.rules = rules  # type: ignore[attr-defined]
    return composed


def describe(rule: Rule) -> str:
    """A short account of a rule for error messages."""
    if isinstance(rule, PatternRules):
        return "patterns " + ", ".join(repr(k) for k, _ in rule.table)
    inner = getattr(rule, "rules", None)
    if inner:
        return "; ".join(describe(r) for r in inner)
    return getattr(rule, "__name__", repr(rule))



def _first(paths: list[str], n: int = 10) -> str:
    return ", ".join(paths[:n]) + (f" and {len(paths) - n} more" if len(paths) > n else "")


def apply_rules(tree: Any, rule: Callable[[str, Any], P | None], /) -> Any:
    """A tree of `P`, the structure of `tree`, from `rule(path, leaf)`.

    Raises, naming every path, for leaves no rule claims and for specs longer
    than their tensor's rank.

    Example:
        >>> params = {"embed": ShapeDtype((16, 8)), "out": {"w": ShapeDtype((8, 16))}}
        >>> apply_rules(params, lambda path, leaf: P("tp") if path == "embed" else P())
        {'embed': P('tp'), 'out': {'w': P()}}
    """
    pairs, treespec = flatten_with_paths(tree)
    out, unmatched, errors, not_p = [], [], [], {}
    for path, leaf in pairs:
        spec = rule(path, leaf)
        if spec is None:
            unmatched.append(path)
        elif not isinstance(spec, P):
            not_p.setdefault(repr(spec)[:200], []).append(path)
        elif hasattr(leaf, "shape") and len(spec) > leaf_ndim(leaf):
            errors.append(
                f"{path}: spec {spec!r} has {len(spec)} entries but the tensor has rank "
                f"{leaf_ndim(leaf)} (shape {leaf_shape(leaf)})"
            )
        out.append(spec)
    for given, paths in not_p.items():  # one line per value given, however many leaves it was given for
        errors.append(
            f"the rule gave {given}, not a P, for {plural(len(paths), 'leaf', 'leaves')}: {_first(paths)}. Fix: "
            "return a P (or None) from the rule; a function of the mesh that makes rules is called with the mesh first"
        )
    if unmatched:
        shown = _first(unmatched)
        errors.insert(
            0,
            f"no rule ({describe(rule)}) matches {plural(len(unmatched), 'leaf', 'leaves')}: {shown}. "
            "Fix: add a pattern for them, or give the rules a default=P()",
        )
    if errors:
        raise ValueError("; ".join(errors))
    return optree.tree_unflatten(treespec, out)

