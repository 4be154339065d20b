"""`experts_ep`: the experts of a mixture-of-experts layer, per shard, inside `shard_map` over axis `ep`.

Each rank holds its tokens `x` (T, H), their routing `top_k_index` / `top_k_weights` (T, k), and its
E/ep experts (rank r: experts r*E/ep .. (r+1)*E/ep - 1). A (token, slot) pair is one entry of
`top_k_index`; its row is a copy of its token's row of `x`.

Dropless (the default), per layer forward:

1. sort the pairs by expert (stable: token order within an expert) and count them per expert;
2. exchange the counts over `ep` (`lax.all_to_all` of device tensors), then read this rank's send and
   receive counts to the host in one sync (`routing.read_counts`, counted in `SYNCS`); the combine and
   both backward exchanges reuse those counts, so the backward reads nothing;
3. dispatch the rows with `lax.all_to_all_v` into buffers of their exact sizes, regroup what arrived by
   local expert, run the experts (`grouped.expert_mlp`), put the results back in arrival order, and
   send them home with the swapped exchange;
4. unsort, and combine: (T, k, H) times the weights, summed over k. No scatter-add, no atomics: the
   same inputs give the same bits (every scatter here, forward or backward, writes each row once).

Capacity mode (`capacity_factor=c`): each expert takes at most C = ceil(c * T * k / E) pairs from each
source rank: the first C this rank routes to it, in (token, slot) order (`routing.capacity_dropped`
says which are dropped; they add zero). The capacity is per source rank, so every rank decides alone,
every buffer has a fixed size (E * C rows), the exchanges are plain `lax.all_to_all`s, and nothing is
read to the host. The dropped pairs are added up on the device in `routing.DROPPED`, read when reported.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .. import lax
from ..spmd.records import Expected
from ..spmd.vma import vma
from .grouped import expert_mlp
from .routing import DROPPED, capacity, expert_counts, positions, read_counts

__all__ = ["assumed_load", "experts_ep"]


class _Load(threading.local):
    share = 1.0


_LOAD = _Load()


@contextlib.contextmanager
def assumed_load(share: float):
    """Within it, a dropless layer on meta tensors (a dry run: no counts to read) gives this rank's experts
    `share` times an even share of the pairs from each source rank (`Parallelism.expert_load`)."""
    saved, _LOAD.share = _LOAD.share, share
    try:
        yield
    finally:
        _LOAD.share = saved


def experts_ep(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor, /, *, axis="ep", capacity_factor: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """The experts' output for this rank's tokens, (T, H): for each token, the sum over its slots j of
    `top_k_weights[t, j] * expert_e(x[t])`, e = `top_k_index[t, j]` (a global expert id, in [0, E)),
    expert_e(v) = `down_proj[e] @ (silu(g) * u)` with `[g, u] = gate_up_proj[e] @ v` in halves.

    Call it inside `shard_map(experts_ep, mesh=mesh, in_specs=(P(data), P(data), P(data), P("ep"),
    P("ep")), out_specs=P(data))`, `data` the axes the tokens are split over (e.g. ("dp", "ep")); with
    `axis=None` every expert is on this rank and nothing is exchanged. See the module docstring for the
    dropless and capacity modes (`capacity_factor=None`: dropless)."""
    _check(x, top_k_index, top_k_weights, gate_up_proj, down_proj)
    tokens, top_k = top_k_index.shape
    n = 1 if axis is None else lax.axis_size(axis)
    gate_up, down = (_varying_like(w, x) for w in (gate_up_proj, down_proj))
    pairs = x.unsqueeze(1).expand(tokens, top_k, x.shape[1]).reshape(tokens * top_k, x.shape[1])
    flat = top_k_index.reshape(-1).long()
    if capacity_factor is None:
        out = _dropless(pairs, flat, gate_up, down, axis, n)
    else:
        cap = capacity(tokens, top_k, n * gate_up.shape[0], capacity_factor)
        out = _capped(pairs, flat, gate_up, down, axis, n, cap)
    return (out.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1)).sum(1).to(x.dtype)


def _dropless(pairs, flat, gate_up, down, axis, n: int) -> torch.Tensor:
    """Each pair's expert output, (T*k, H) in pair order: exact-size exchanges, one host read."""
    local = gate_up.shape[0]
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, n * local)
    arriving = counts if axis is None else lax.all_to_all(counts, axis, 0, 0, tiled=True)  # [source][expert]
    sent, got = _host_counts(counts, arriving, pairs.shape[0], local, n)
    send_rows = [sum(sent[j * local : (j + 1) * local]) for j in range(n)]
    recv_rows = [sum(got[s * local : (s + 1) * local]) for s in range(n)]
    group_rows = [sum(got[s * local + e] for s in range(n)) for e in range(local)]
    price = Expected(pairs.shape[0] * (n - 1) // n)  # for a dry run: balanced routing
    rows = pairs.index_select(0, order)
    if axis is not None:  # else every expert is here: nothing leaves
        rows = lax.all_to_all_v(rows, axis, send_rows, recv_rows, price=price)
    regroup = _by_local_expert(arriving, local, n, sum(recv_rows))
    out = expert_mlp(rows.index_select(0, regroup), group_rows, gate_up, down)
    out = out.index_select(0, _inverse(regroup))  # back in arrival order
    home = out if axis is None else lax.all_to_all_v(out, axis, recv_rows, send_rows, price=price)
    return home.index_select(0, _inverse(order))


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `perm`. Rows go back with `index_select` (whose backward keeps only the
    index), not `index_copy`, whose backward keeps its source: a whole (pairs, H) buffer per layer."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def _host_counts(counts, arriving, pairs: int, local: int, n: int) -> tuple[list[int], list[int]]:
    """(pairs this rank sends each expert, pairs each source sends each local expert) as Python ints: one
    host read. On meta tensors (a dry run, the vma check) there are no values: balanced routing instead, this
    rank's experts receiving `assumed_load`'s share."""
    read = read_counts(counts, arriving)
    if read is not None:
        sent, got = read
        return sent, got
    even = [pairs // (n * local) + (e < pairs % (n * local)) for e in range(n * local)]
    share = _LOAD.share if n > 1 else 1.0  # on one rank every pair stays, however they spread
    return even, [round(c * share) for c in even[:local]] * n


def _by_local_expert(arriving: torch.Tensor, local: int, n: int, rows: int) -> torch.Tensor:
    """The permutation that regroups arrived rows ([source][local expert]) by local expert, stably."""
    blocks = torch.arange(local, device=arriving.device).repeat(n)
    return torch.argsort(torch.repeat_interleave(blocks, arriving, output_size=rows), stable=True)


def _capped(pairs, flat, gate_up, down, axis, n: int, cap: int) -> torch.Tensor:
    """Each pair's expert output, (T*k, H) in pair order, zero for dropped pairs: fixed-size exchanges of
    `cap` rows per (rank, expert), no host read."""
    local, hidden = gate_up.shape[0], pairs.shape[1]
    experts = n * local
    place = positions(flat, experts)
    DROPPED.note((place >= cap).sum())
    slot = torch.where(place < cap, flat * cap + place, experts * cap)  # dropped: a spare last row
    source = torch.full((experts * cap + 1,), pairs.shape[0], device=slot.device)  # unfilled: the zero row
    source = source.scatter_(0, slot, torch.arange(pairs.shape[0], device=slot.device))[:-1]  # (the spare row goes)
    buf = torch.cat([pairs, pairs.new_zeros((1, hidden))]).index_select(0, source)
    rows = buf if axis is None else lax.all_to_all(buf, axis, 0, 0, tiled=True)  # [source][local expert][slot]
    rows = rows.reshape(n, local, cap, hidden).transpose(0, 1).reshape(local * n * cap, hidden)
    out = expert_mlp(rows, [n * cap] * local, gate_up, down)
    out = out.reshape(local, n, cap, hidden).transpose(0, 1).reshape(experts * cap, hidden)
    home = out if axis is None else lax.all_to_all(out, axis, 0, 0, tiled=True)  # [expert][slot]: this rank's
    return torch.cat([home, home.new_zeros((1, hidden))]).index_select(0, slot)


def _varying_like(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`w` cast once to vary over the axes `x` varies over (the data axes besides ep): its gradient is then
    summed over them in one psum, not one per expert slice that meets the tokens."""
    extra = tuple(a for a in vma(x) if a not in vma(w))
    return lax.pcast(w, extra, to="varying") if extra else w


def _check(x, top_k_index, top_k_weights, gate_up_proj, down_proj) -> None:
    shapes = {n: tuple(t.shape) for n, t in zip(_NAMES, (x, top_k_index, top_k_weights, gate_up_proj, down_proj))}
    ok = x.dim() == 2 and top_k_index.dim() == 2 and gate_up_proj.dim() == 3 and down_proj.dim() == 3
    if ok:
        (tokens, hidden), (experts, inner2, _) = x.shape, gate_up_proj.shape
        ok = (
            top_k_index.shape[0] == tokens and top_k_weights.shape == top_k_index.shape and inner2 % 2 == 0
            and gate_up_proj.shape[2] == hidden and down_proj.shape == (experts, hidden, inner2 // 2)
        )  # fmt: skip
    if not ok:
        raise ValueError(
            f"experts_ep: shapes {shapes} do not fit x (T, H), top_k_index and top_k_weights (T, k), gate_up_proj "
            "(E/ep, 2I, H), down_proj (E/ep, H, I) (per shard)"
        )
    if top_k_index.is_floating_point() or top_k_index.is_complex():
        raise TypeError(f"experts_ep: top_k_index holds expert ids, an integer tensor; got {top_k_index.dtype}")


_NAMES = ("x", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")
