"""Layouts at scale: rules, shardings and every rank's slices for 10,000 tensors on 4,096 ranks.

Two param trees of `ShapeDtype` leaves, both named like Llama (tok_embeddings,
layers.N.attention.wq/wk/wv/wo, layers.N.feed_forward.w1/w2/w3, the norms,
output), with layers added until there are at least `--leaves` leaves:

- `llama`: every layer has Llama-3-8B's shapes, so a handful of distinct
  (spec, shape) pairs repeat thousands of times (the layout cache's best case);
- `distinct`: the same paths, but every leaf's shape is different (its worst
  case: no cache hits at all).

On `Mesh(dp=16, pp=4, cp=4, tp=16)` (4,096 ranks) each run times four phases:
`apply_rules` with a composed rule set (a glob table with einops dim names
through logical rules, a shape-dependent embedding rule, a replicate-small
fallback), `tree_shardings`, `rank_indices(shape)` for every leaf, and the
JAX-style `devices_indices_map(shape)` dict for every leaf. The layout caches
are cleared before each run and before each of the two layout phases, so both
start cold. Each number is the median of `--runs` runs (time.perf_counter).

Run from the repository root:

    python benchmarks/bench_layouts.py              # the README numbers
    python benchmarks/bench_layouts.py --profile    # + where the distinct-shape time goes
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.metadata
import io
import math
import os
import platform
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

try:
    import meshlib
except ImportError:  # run from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import meshlib

from meshlib import Mesh, P, ShapeDtype
from meshlib import sharding as _sharding

MESH = Mesh(dp=16, pp=4, cp=4, tp=16)
# Llama-3-8B: dim 4096, 32 heads of 128, 8 kv heads, ffn 14336, vocab 128256.
DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 4096, 32, 8, 128, 14336, 128256
# Every split dim below is split 16 ways (tp) or 64 ways (dp x cp); adding multiples
# of 64 keeps it divisible while making every shape distinct.
STEP = 64


# -- the trees ---------------------------------------------------------------------------
def _layer() -> dict:
    w = lambda rows, cols: ShapeDtype((rows, cols), "bfloat16")
    return {
        "attention": {
            "wq": w(HEADS * HEAD_DIM, DIM),
            "wk": w(KV_HEADS * HEAD_DIM, DIM),
            "wv": w(KV_HEADS * HEAD_DIM, DIM),
            "wo": w(DIM, HEADS * HEAD_DIM),
        },
        "feed_forward": {"w1": w(HIDDEN, DIM), "w2": w(DIM, HIDDEN), "w3": w(HIDDEN, DIM)},
        "attention_norm": ShapeDtype((DIM,)),
        "ffn_norm": ShapeDtype((DIM,)),
    }


def llama_tree(min_leaves: int) -> dict:
    """Llama with as many layers as it takes to reach `min_leaves` leaves."""
    per_layer, top = 9, 3
    layers = max(1, math.ceil((min_leaves - top) / per_layer))
    return {
        "tok_embeddings": ShapeDtype((VOCAB, DIM), "bfloat16"),
        "layers": [_layer() for _ in range(layers)],
        "norm": ShapeDtype((DIM,)),
        "output": ShapeDtype((VOCAB, DIM), "bfloat16"),
    }


def distinct_tree(min_leaves: int) -> dict:
    """The same paths, every leaf's shape made unique (each dim grown by a multiple of STEP)."""
    like = llama_tree(min_leaves)
    flat = meshlib.flatten_dotted(like)
    grown = {
        path: ShapeDtype(tuple(n + STEP * (i + 1) for n in leaf.shape), leaf.dtype)
        for i, (path, leaf) in enumerate(flat.items())
    }
    return meshlib.unflatten_dotted(grown, like)


# -- the rules ---------------------------------------------------------------------------
LOGICAL = meshlib.logical_rules({"vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "embed": ("dp", "cp")})
TENSOR_PARALLEL = meshlib.pattern_rules(
    {
        "layers.*.attention.wq": "heads embed",
        "layers.*.attention.w[kv]": "kv_heads embed",
        "layers.*.attention.wo": "embed heads",
        "layers.*.feed_forward.w[13]": "mlp embed",
        "layers.*.feed_forward.w2": "embed mlp",
    },
    logical=LOGICAL,
)


def _vocab_parallel(path, leaf):
    """Split the vocab over tp when it divides evenly, else only the embed dim."""
    vocab, _ = leaf.shape
    return P("tp", ("dp", "cp")) if vocab % MESH.axis_size("tp") == 0 else P(None, ("dp", "cp"))


def _replicate_small(path, leaf):
    return P() if len(leaf.shape) < 2 else None


RULES = meshlib.compose(
    TENSOR_PARALLEL,
    meshlib.pattern_rules({"tok_embeddings": _vocab_parallel, "output": _vocab_parallel}),
    _replicate_small,
)


# -- the phases --------------------------------------------------------------------------
def _clear_caches() -> None:
    _sharding._indices.cache_clear()
    _sharding._block_index.cache_clear()
    _sharding._dim_slices.cache_clear()


def _pairs(tree, shardings) -> list:
    """`[(sharding, shape), ...]` in leaf order."""
    shapes = [leaf.shape for leaf in meshlib.flatten_dotted(tree).values()]
    return list(zip(meshlib.flatten_dotted(shardings).values(), shapes, strict=True))


def _all_rank_indices(pairs) -> int:
    return sum(len(sharding.rank_indices(shape)) for sharding, shape in pairs)


def _all_indices_maps(pairs) -> int:
    return sum(len(sharding.devices_indices_map(shape)) for sharding, shape in pairs)


def run_once(tree) -> dict[str, float]:
    """One cold run of every phase; seconds per phase."""
    times = {}
    _clear_caches()
    t0 = time.perf_counter()
    specs = meshlib.apply_rules(tree, RULES)
    t1 = time.perf_counter()
    shardings = meshlib.tree_shardings(tree, specs, MESH)
    t2 = time.perf_counter()
    times["apply_rules"], times["tree_shardings"] = t1 - t0, t2 - t1

    pairs = _pairs(tree, shardings)
    _clear_caches()
    t0 = time.perf_counter()
    slices = _all_rank_indices(pairs)
    times["rank_indices, every leaf"] = time.perf_counter() - t0
    _clear_caches()
    t0 = time.perf_counter()
    entries = _all_indices_maps(pairs)
    times["devices_indices_map, every leaf"] = time.perf_counter() - t0
    if slices != entries or slices != len(pairs) * MESH.size:
        raise RuntimeError(f"expected {len(pairs)} x {MESH.size} rank slices, got {slices} and {entries}")
    _clear_caches()
    return times


def bench(name: str, tree, runs: int) -> dict:
    flat = meshlib.flatten_dotted(tree)
    specs = meshlib.flatten_dotted(meshlib.apply_rules(tree, RULES))
    distinct = len({(specs[p], leaf.shape) for p, leaf in flat.items()})
    samples = [run_once(tree) for _ in range(runs)]
    gc.collect()
    medians = {phase: statistics.median(s[phase] for s in samples) for phase in samples[0]}
    return {"tree": name, "leaves": len(flat), "distinct": distinct, "medians": medians}


def profile_distinct(tree, top: int = 12) -> str:
    """cProfile of the cold `rank_indices` phase on the distinct-shape tree."""
    shardings = meshlib.tree_shardings(tree, meshlib.apply_rules(tree, RULES), MESH)
    pairs = _pairs(tree, shardings)
    _clear_caches()
    profiler = cProfile.Profile()
    profiler.runcall(_all_rank_indices, pairs)
    _clear_caches()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# -- the report --------------------------------------------------------------------------
def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    return {
        "cpu": cpu,
        "cores": str(cores),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "versions": f"meshlib {meshlib.__version__}, optree {version('optree')}, einops {version('einops')}",
    }


COLUMNS = ("phase", "llama: median s", "distinct: median s")


def rows(results: list[dict]) -> list[tuple[str, ...]]:
    phases = list(results[0]["medians"])
    out = [(phase, *(f"{r['medians'][phase]:.3f}" for r in results)) for phase in phases]
    out.append(("total", *(f"{sum(r['medians'].values()):.3f}" for r in results)))
    return out


def markdown(results: list[dict], info: dict[str, str], runs: int) -> str:
    head = [f"| {' | '.join(COLUMNS)} |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    body = [f"| {' | '.join(row)} |" for row in rows(results)]
    setup = (
        f"{MESH!r} ({MESH.size:,} ranks); leaves: "
        + ", ".join(f"{r['tree']} {r['leaves']:,} ({r['distinct']:,} distinct spec+shape)" for r in results)
        + f"; median of {runs} runs"
    )
    machine_lines = [f"- {k}: {v}" for k, v in info.items()]
    return "\n".join([setup, "", *head, *body, "", *machine_lines])


def show(results: list[dict], info: dict[str, str], runs: int) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return
    table = Table(title=f"layouts on {MESH!r}, {MESH.size:,} ranks (median of {runs})")
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows(results):
        table.add_row(*row)
    machine_table = Table(title="machine", show_header=False)
    for key, value in info.items():
        machine_table.add_row(key, value)
    Console().print(table, machine_table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=10_000, help="at least this many leaves per tree")
    parser.add_argument("--runs", type=int, default=5, help="runs per tree; the median is reported")
    parser.add_argument("--profile", action="store_true", help="profile the distinct-shape rank_indices phase")
    args = parser.parse_args(argv)

    results = [
        bench("llama", llama_tree(args.leaves), args.runs),
        bench("distinct", distinct_tree(args.leaves), args.runs),
    ]
    info = machine()
    info["peak RSS"] = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB"
    show(results, info, args.runs)
    print("\nMarkdown:\n")
    print(markdown(results, info, args.runs))
    if args.profile:
        print("\nProfile of rank_indices over the distinct-shape tree (cold cache):\n")
        print(profile_distinct(distinct_tree(args.leaves)))


if __name__ == "__main__":
    main()
