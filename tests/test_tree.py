"""Spec trees: jax.tree_util leaf order and paths, rules over trees, checks with paths."""

import collections

import jax
import pytest

from meshlib import (
    Mesh,
    NamedSharding,
    P,
    ShapeDtype,
    apply_rules,
    flatten_dotted,
    flatten_with_paths,
    pattern_rules,
    tree_shardings,
    unflatten_dotted,
)

Pair = collections.namedtuple("Pair", "kernel bias")


def _tree():
    leaf = lambda *s: ShapeDtype(s)  # noqa: E731
    return {
        "layers": [{"attn": Pair(leaf(8, 8), leaf(8)), "norm": leaf(8)}, {"attn": Pair(leaf(8, 8), None), "norm": leaf(8)}],
        "embed": (leaf(16, 8),),
        "od": collections.OrderedDict([("z", leaf(2)), ("a", leaf(3))]),
    }


def _keystr(path):
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return ".".join(parts)


def test_leaf_order_and_paths_equal_jax_tree_util():
    tree = _tree()
    ours, _ = flatten_with_paths(tree)
    theirs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, ShapeDtype))
    assert [p for p, _ in ours] == [_keystr(path) for path, _ in theirs]
    assert [leaf for _, leaf in ours] == [leaf for _, leaf in theirs]
    assert ours[0][0] == "embed.0"


def test_torch_style_flat_dict_and_unflatten():
    flat = {"tok.weight": ShapeDtype((16, 8)), "layers.0.w": ShapeDtype((8, 8))}
    assert list(flatten_dotted(flat)) == ["layers.0.w", "tok.weight"]  # sorted, as jax sorts dict keys
    nested = unflatten_dotted(flat)
    assert nested == {"tok": {"weight": flat["tok.weight"]}, "layers": {"0": {"w": flat["layers.0.w"]}}}
    tree = _tree()
    assert unflatten_dotted(flatten_dotted(tree), like=tree) == tree
    with pytest.raises(ValueError, match="missing"):
        unflatten_dotted({"x": 1}, like=tree)


def test_apply_rules_keeps_structure():
    tree = _tree()
    rule = pattern_rules({"**.kernel": P(None, "tp"), "**.bias": P("tp"), "embed.*": P("tp")}, default=P())
    specs = apply_rules(tree, rule)
    assert specs["layers"][0]["attn"] == Pair(P(None, "tp"), P("tp"))
    assert specs["layers"][1]["attn"] == Pair(P(None, "tp"), None)
    assert specs["embed"] == (P("tp"),)
    assert list(specs["od"]) == ["z", "a"]
    shardings = tree_shardings(tree, specs, Mesh(dp=2, tp=4))
    assert shardings["layers"][0]["attn"].kernel == NamedSharding(Mesh(dp=2, tp=4), P(None, "tp"))


def test_unmatched_and_bad_specs_are_all_named():
    tree = _tree()
    with pytest.raises(ValueError, match=r"no rule \(patterns '\*\*\.kernel'\) matches 6 leaves: embed\.0, layers\.0\.attn\.bias"):
        apply_rules(tree, pattern_rules({"**.kernel": P()}))
    with pytest.raises(ValueError, match=r"layers\.0\.norm: spec P\('dp', 'tp'\) has 2 entries but the tensor has rank 1"):
        apply_rules(tree, pattern_rules({"**.norm": P("dp", "tp")}, default=P()))
    specs = apply_rules(tree, pattern_rules({"od.a": P("tp"), "embed.0": P("cp")}, default=P()))
    with pytest.raises(ValueError) as info:
        tree_shardings(tree, specs, Mesh(dp=2, tp=4))
    msg = str(info.value)
    assert "2 specs cannot be laid out on Mesh(dp=2, tp=4)" in msg
    assert "od.a: dim 0 of shape (3,) has size 3" in msg
    assert "embed.0: spec P('cp') names mesh axis 'cp'" in msg
