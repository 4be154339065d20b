"""Context parallelism, per shard: attention over a sequence split along a mesh axis (`cp`), run inside
`shard_map` with q, k, v split along their sequence dim.

    y = shard_map(functools.partial(ring_attention, causal=True, layout="zigzag"), mesh=Mesh(dp=2, cp=4),
                  in_specs=(P("dp", None, "cp"),) * 3, out_specs=P("dp", None, "cp"))(q, k, v)

Per rank, with L = S/cp tokens of every head (B, H, L, D), each function gives that rank's rows of
softmax(Q Kᵀ/√D + mask) V over the whole sequence:

- `ring_attention` (`ring`): queries stay, keys and values go around the ring, cp-1 `ppermute` hops, each
  block merged by log-sum-exp (`local`); backward sends them around again with their gradients, so a rank
  keeps O(S/cp). The hops are asynchronous: each is under way while a block is computed, forward and backward.
- `allgather_attention` (`allgather`): keys and values gathered once, then the same blocks.
- `ulysses_attention` (`ulysses`): all-to-all from sequence shards to head shards and back (DeepSpeed-Ulysses);
  query and key/value heads multiples of cp.

All three take `causal`, GQA (fewer key/value heads, never repeated before they move), a boolean or additive
`mask` (each rank passes its query rows and every key column, `inputs`), packed documents (`doc_ids`,
split like the tokens) and `layout`: "contiguous" (the sequence as `P("cp")` splits it) or "zigzag" (rank i
holds chunks i and 2cp-1-i of 2cp: causal work balanced; `to_zigzag` / `from_zigzag` / `zigzag_indices`).
`attention_flops_per_rank` is the closed form of each rank's score FLOPs, and `SCORES` (a `ScoreCounter`)
counts the blocks the code computed. Every argument is checked before any collective.
"""

from .allgather import allgather_attention
from .flops import SCORES, ScoreCounter, attention_flops_per_rank
from .ring import ring_attention
from .ulysses import ulysses_attention
from .zigzag import from_zigzag, to_zigzag, zigzag_indices

__all__ = [
    "SCORES", "ScoreCounter", "allgather_attention", "attention_flops_per_rank", "from_zigzag", "ring_attention",
    "to_zigzag", "ulysses_attention", "zigzag_indices",
]  # fmt: skip
