"""Per-shard code with JAX's semantics: `shard_map` and the collectives of `meshlib_torch.lax`.

The one seam for rank-dependent code (DESIGN.md): vocab-parallel embedding and loss, MoE dispatch and
combine, ring attention. Its parts, one concern each:

    region       the region `f` runs in (mesh, backend, typing), found by the lax collectives
    vma          the axes each value varies over (JAX's check_vma), applied to every torch op
    collectives  the collectives as autograd functions, each with JAX's transpose
    backend      the seam to communication, and `MetaBackend`, which records instead of running
    specs        specs beside arguments and results: matching, checks, shapes, DTensor placements
    boundary     shard_map's edges: whole values or DTensors in, DTensors out, and their gradients
    run          `run_region`: f on one rank's shards inside a region, results checked against out specs
    plan         the abstract run: the vma check, and `region_collectives` for the compiler
    eager        `EagerBackend`: c10d on a DeviceMesh's groups, counted in `COUNTER`
    shard_map    the eager entry point (with `eager`, the only parts that need process groups)

## Seams for the compiler

1. **Listing a region's collectives in the plan.** `plan.region_collectives(f, mesh=, in_specs=,
   out_specs=, args=)` runs `f` once on meta tensors of the local shapes (`args`: meta tensors or
   `meshlib.ShapeDtype`s, one rank's shards), forward and backward, and returns a `RegionPlan`:
   `records` (one `records.Record` per collective: lax op, plan kind, axes, group size, bytes per
   rank, phase, the user's source line, and `priced`: "exact", or "bound"/"expected" for a ragged
   all-to-all or all_to_all_v priced from the `price=` its caller declared), and the results' local
   shapes and varying axes. `Record.to_collective(node=...)` is the plan's `meshlib.Collective`. It raises,
   before anything runs, every error shard_map would (a broken out-spec promise included).
2. **Running a region inside a compiled model.** `run.run_region(f, region, args, in_specs=,
   out_specs=)` runs `f` on this rank's shards `args` in a `region.Region(mesh, backend,
   check_vma=...)` (set `region.mode = vma.VmaMode(region)` to type values): inputs typed by their
   specs, results checked and cast to the out specs. The backend is `eager.EagerBackend(mesh,
   device_mesh, counter)` for c10d counted in your counter, or one of your own (the protocol is in
   `backend`'s docstring: eight primitives and `axis_index`). The lax collectives find the region
   themselves; gradients take JAX's transposes through autograd.
3. **The typing rules** are `vma.vma(t)` / `vma.set_vma` on any tensor, so a pass that rewrites
   rank-dependent ops into a region can type its inputs the way their specs say.
"""

from .backend import MetaBackend
from .plan import RegionPlan, region_collectives
from .records import Bound, Call, Expected, Record
from .region import Axes, Region
from .run import run_region

__all__ = [
    "Axes", "Bound", "Call", "Expected", "MetaBackend", "Record", "Region", "RegionPlan", "region_collectives",
    "run_region",
]  # fmt: skip
