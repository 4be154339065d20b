"""`python -m meshlib`: a short tour of the core, with no torch and no processes.

It builds a `dp=2, tp=2, pp=2` mesh, writes the specs of a small transformer
from rules, prints them as a Plan, and draws two layouts.
"""

from __future__ import annotations

from . import (
    Mesh,
    NamedSharding,
    P,
    Plan,
    ShapeDtype,
    apply_rules,
    compose,
    flatten_dotted,
    layout,
    logical_rules,
    pattern_rules,
    tree_shardings,
)
from ._table import show


def transformer(*, layers: int = 2, dim: int = 16, hidden: int = 32, vocab: int = 64) -> dict:
    """A Llama-shaped tree of abstract leaves (shapes and dtypes only)."""
    block = lambda: {  # noqa: E731
        "attention": {name: ShapeDtype((dim, dim), "bfloat16") for name in ("wq", "wk", "wv", "wo")},
        "feed_forward": {
            "w1": ShapeDtype((hidden, dim), "bfloat16"),
            "w2": ShapeDtype((dim, hidden), "bfloat16"),
            "w3": ShapeDtype((hidden, dim), "bfloat16"),
        },
        "attention_norm": ShapeDtype((dim,)),
        "ffn_norm": ShapeDtype((dim,)),
    }
    return {
        "tok_embeddings": ShapeDtype((vocab, dim), "bfloat16"),
        "layers": [block() for _ in range(layers)],
        "norm": ShapeDtype((dim,)),
        "output": ShapeDtype((vocab, dim), "bfloat16"),
    }


def main() -> None:
    mesh = Mesh(dp=2, tp=2, pp=2)
    params = transformer()
    logical = logical_rules({"vocab": "tp", "heads": "tp", "mlp": "tp", "embed": "dp"})
    rules = compose(
        pattern_rules(
            {
                "layers.*.attention.w[qkv]": "heads embed",
                "layers.*.attention.wo": "embed heads",
                "layers.*.feed_forward.w[13]": "mlp embed",
                "layers.*.feed_forward.w2": "embed mlp",
                "tok_embeddings": "vocab embed",
                "output": "vocab embed",
            },
            logical=logical,
        ),
        lambda path, leaf: P() if len(leaf.shape) < 2 else None,  # norms: whole on every rank
    )
    specs = apply_rules(params, rules)
    tree_shardings(params, specs, mesh)  # every shape checked against the mesh
    plan = Plan(mesh, specs=flatten_dotted(specs), notes={"model": "transformer, 2 layers (abstract)"})
    show(
        f"meshlib demo on {mesh!r}: {mesh.size} ranks, no torch, no processes",
        plan,
        layout(mesh, specs["layers"][0]["attention"]["wq"], params["layers"][0]["attention"]["wq"].shape),
        layout(NamedSharding(mesh, P("pp", ("tp", "dp"))), (4, 8)),
    )


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:  # `python -m meshlib plan ...` is the `meshlib` command
        from .cli import main as cli_main

        cli_main(sys.argv[1:])
    else:
        main()
