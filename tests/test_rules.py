"""Rules: glob/regex tables, Flax logical-axis semantics, einops dim names, composition."""

import pytest

from meshlib import P, ShapeDtype, compose, dims, logical_rules, pattern_rules

W = ShapeDtype((8, 8))


@pytest.mark.parametrize(
    "pattern, path, hit",
    [
        ("layers.*.attn.wq.weight", "layers.3.attn.wq.weight", True),
        ("layers.*.attn.wq.weight", "layers.3.mlp.attn.wq.weight", False),  # * is one segment
        ("**.weight", "weight", True),
        ("**.weight", "a.b.c.weight", True),
        ("layers.**.bias", "layers.bias", True),
        ("layers.**.bias", "layers.0.x.bias", True),
        ("**.w[qkv].weight", "l.0.wk.weight", True),
        ("**.w[!qkv].weight", "l.0.wk.weight", False),
        ("**.w?.weight", "l.0.wo.weight", True),
        ("tok_*", "tok_emb", True),
        ("tok_*", "tok_emb.weight", False),
        (r"re:layers\.\d+\.(wq|wk)\.weight", "layers.12.wk.weight", True),
        (r"re:layers\.\d+\.(wq|wk)\.weight", "layers.12.wk.weight.x", False),
        ("a.b", "aXb", False),  # dots are literal
    ],
)
def test_globs_and_regexes(pattern, path, hit):
    rule = pattern_rules({pattern: P("tp")})
    assert (rule(path, W) == P("tp")) is hit
    assert rule(path, W) is None or hit


def test_ambiguous_match_names_path_and_both_patterns():
    rule = pattern_rules({"**.weight": P(), "layers.*.wq.weight": P("tp")})
    with pytest.raises(ValueError, match=r"layers\.0\.wq\.weight: ambiguous, matched by patterns '\*\*\.weight' and "):
        rule("layers.0.wq.weight", W)


def test_default_and_values():
    rule = pattern_rules(
        {"a": None, "b": ("dp", None), "c": lambda path, leaf: P("tp") if leaf.shape[0] % 4 == 0 else P()},
        default=P("dp"),
    )
    assert rule("a", W) == P()
    assert rule("b", W) == P("dp", None)
    assert rule("c", ShapeDtype((8,))) == P("tp") and rule("c", ShapeDtype((6,))) == P()
    assert rule("zzz", W) == P("dp")


def test_rules_see_dtype():
    rule = pattern_rules({"**": lambda path, leaf: P() if leaf.dtype == "int64" else P("dp")})
    assert rule("step", ShapeDtype((), "int64")) == P()
    assert rule("w", ShapeDtype((4,), "bfloat16")) == P("dp")


def test_flax_logical_rules_first_unused_axis_wins():
    # Closed-form cases from Flax's semantics (flax.linen.partitioning.logical_to_mesh_axes).
    rules = logical_rules([("batch", "dp"), ("heads", "tp"), ("mlp", "tp"), ("embed", None), ("kv", "tp")])
    assert rules.mesh_axes(["batch", "embed", "mlp"]) == ["dp", None, "tp"]
    assert rules.mesh_axes(["heads", "mlp"]) == ["tp", None]  # tp already used by heads
    assert rules.mesh_axes(["mlp", "heads"]) == [None, "tp"]  # rule order, not dim order, decides
    assert rules.mesh_axes(["unknown", None]) == [None, None]
    # A logical name may have fallbacks: the next rule with that name applies if its axis is free.
    fallback = logical_rules([("embed", "tp"), ("vocab", "tp"), ("vocab", "dp")])
    assert fallback.mesh_axes(["vocab", "embed"]) == ["dp", "tp"]
    multi = logical_rules({"batch": ("dp", "cp"), "seq": "cp"})
    assert multi.mesh_axes(["batch", "seq"]) == [("dp", "cp"), None]
    with pytest.raises(ValueError, match=r"\['batch'\] occur more than once"):
        rules.mesh_axes(["batch", "batch"])


def test_einops_dim_names():
    logical = {"batch": "dp", "seq": "cp", "heads": "tp", "embed": None}
    assert dims("batch seq embed", logical=logical) == P("dp", "cp", None)
    assert dims("batch (heads hd) embed", logical=logical) == P("dp", "tp", None)
    assert dims("... heads", logical=logical, ndim=4) == P(None, None, None, "tp")
    assert dims("batch 1 embed", logical=logical) == P("dp", None, None)
    with pytest.raises(ValueError, match="name 3 dims but the tensor has 2"):
        dims("batch seq embed", logical=logical, ndim=2)
    with pytest.raises(ValueError, match="do not parse"):
        dims("batch (seq", logical=logical)
    rule = pattern_rules({"**.wq.weight": "(heads hd) embed"}, logical=logical)
    assert rule("l.wq.weight", W) == P("tp", None)
    with pytest.raises(ValueError, match=r"l\.wq\.weight: dim names .* name 2 dims but the tensor has 1"):
        rule("l.wq.weight", ShapeDtype((8,)))
    with pytest.raises(ValueError, match="need logical rules"):
        pattern_rules({"x": "batch embed"})


def test_compose_first_match_wins():
    specific = pattern_rules({"**.wq.weight": P("tp", None)})
    general = pattern_rules({"**.weight": P(), "**.bias": P()})
    rule = compose(specific, general, default=P("dp"))
    assert rule("l.wq.weight", W) == P("tp", None)
    assert rule("l.wo.weight", W) == P()
    assert rule("l.scale", W) == P("dp")
    assert compose(specific)("l.bias", W) is None


def test_strict_logical_rules_catch_typos_and_defaults_are_checked_early():
    rule = pattern_rules({"a": "heads embed"}, logical=logical_rules({"head": "tp", "embed": None}, strict=True))
    with pytest.raises(ValueError, match=r"logical dim names \['heads'\] have no rule \(strict=True\)"):
        rule("a", W)
    assert pattern_rules({"a": "heads embed"}, logical={"head": "tp"})("a", W) == P(None, None)  # Flax: replicated
    with pytest.raises(ValueError, match="'default' maps to dim names 'heads embed', which need logical rules"):
        pattern_rules({}, default="heads embed")
    with pytest.raises(TypeError, match="compose\\(default='heads embed'\\)"):
        compose(pattern_rules({}), default="heads embed")
    assert pattern_rules({}, default="heads embed", logical={"heads": "tp"})("x", W) == P("tp", None)


def test_a_rule_giving_something_else_than_a_p_is_said_once_for_all_its_leaves():
    """A rules factory passed where a rule goes gives its rules, not a P, for every leaf: one line says so
    (the count, the first ten paths, the fix), not one line per leaf."""
    from meshlib.rules import apply_rules

    params = {f"layers.{i}.w": ShapeDtype((4, 4)) for i in range(30)}
    with pytest.raises(ValueError) as err:
        apply_rules(params, lambda path, leaf: "heads embed")
    text = str(err.value)
    assert text.count("not a P") == 1 and "for 30 leaves: layers.0.w, layers.1.w" in text and "and 20 more" in text
    assert "Fix: return a P (or None) from the rule" in text
