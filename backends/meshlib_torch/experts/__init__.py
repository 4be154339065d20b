"""Expert parallelism, per shard: what a mixture-of-experts layer's experts run inside `shard_map` over `ep`.

    y = shard_map(experts_ep, mesh=mesh, in_specs=(P(data), P(data), P(data), P("ep"), P("ep")),
                  out_specs=P(data))(x, top_k_index, top_k_weights, gate_up_proj, down_proj)

- `experts_ep`: dispatch, the experts' MLPs, combine (`dispatch`); dropless by default, with one host read
  of the routing counts per layer forward (`SYNCS` counts them) and none in backward; or capacity mode
  (`capacity_factor=`), with fixed-size buffers and no host read at all.
- `expert_mlp`: the local experts on rows grouped by expert, a grouped GEMM where torch's kernel takes them
  (`grouped_gemm_runs`), else a loop (`grouped`).
- routing arithmetic (`routing`): `capacity`, `capacity_dropped` (which pairs capacity mode drops: the
  count to report), `tokens_per_expert` (router statistics, summed over the data axes), `expert_counts`.

The exchanges are `lax.all_to_all_v` (meshlib's extension: row counts known on the host) in dropless mode
and `lax.all_to_all` in capacity mode; both are counted in `COUNTER` and recorded by a dry run.
"""

from .dispatch import experts_ep
from .grouped import expert_mlp, grouped_gemm_runs
from .routing import SYNCS, SyncCounter, capacity, capacity_dropped, expert_counts, tokens_per_expert

__all__ = [
    "SYNCS", "SyncCounter", "capacity", "capacity_dropped", "expert_counts", "expert_mlp", "experts_ep",
    "grouped_gemm_runs", "tokens_per_expert",
]  # fmt: skip
