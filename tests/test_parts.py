"""A dim held in unequal parts (`Shard(dim, parts=w)`): its blocks, its collectives and its DTensor.

Method: rank r of n holds rows r/n..(r+1)/n of every part. That block is written three ways in the
code (the collectives' `blocks`, the weights' `shard_indices`, the DTensor's rank order), and each is
checked against the definition computed here from `torch.split` and `torch.chunk`. On gloo ranks,
every collective that moves such a value (all-gather, reduce-scatter, all-to-all to and from a plain
shard, the local pad to a partial sum) is checked against the unsharded value: the reassembled or
summed result must equal it exactly.
"""

import pytest
import torch
import torch.distributed as dist

from meshlib_torch.compiler.placement.placements import Shard, part_sizes
from meshlib_torch.compiler.placement.shapes import local_shape, rank_order, shard_indices
from meshlib_torch.runtime import comm
from meshlib_torch.runtime.dtensor import model_order
from meshlib_torch.testing.pool import get_pool

CASES = [((2, 1, 1), 2), ((2, 1, 1), 4), ((1, 2, 3), 3), ((3, 1), 2)]


def _block(x: torch.Tensor, weights, dim: int, n: int, r: int) -> torch.Tensor:
    """The definition: rank r's chunk of every part, in order."""
    sizes = [w * x.shape[dim] // sum(weights) for w in weights]
    return torch.cat([part.chunk(n, dim)[r] for part in x.split(sizes, dim)], dim)


def _value(weights, n: int, dim: int) -> torch.Tensor:
    shape = [2 * n, 3]
    shape.insert(dim, sum(weights) * n * 2)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)


@pytest.mark.parametrize("weights, n", CASES)
@pytest.mark.parametrize("dim", [0, 1])
def test_every_writing_of_a_ranks_block_is_the_definition(weights, n, dim):
    x, p = _value(weights, n, dim), Shard(dim, parts=weights)
    stacked = comm.blocks(x, p, n)
    for r in range(n):
        want = _block(x, weights, dim, n, r)
        assert torch.equal(stacked[r], want)
        assert torch.equal(x.index_select(dim, shard_indices(x.shape, (p,), (n,), (r,))[dim]), want)
        assert tuple(want.shape) == local_shape(x.shape, (p,), (n,))
    assert torch.equal(comm.unblocks(stacked, p), x)
    in_rank_order = torch.cat([_block(x, weights, dim, n, r) for r in range(n)], dim)  # what DTensor gathers
    assert torch.equal(model_order(in_rank_order, rank_order(x.shape, (p,), (n,))), x)


def test_a_shard_in_parts_is_validated_once_and_says_what_it_is():
    assert repr(Shard(0, parts=(2, 1, 1))) == "S(0/2:1:1)" and repr(Shard(1, 3)) == "S(1/3)"
    assert part_sizes(Shard(0, parts=(2, 1, 1)), 64) == (32, 16, 16) and part_sizes(Shard(0, parts=(2, 1)), 64) is None
    for bad in [(2, 2), (4, 2, 2), (1,), (0, 1), (1.5, 1)]:
        with pytest.raises(ValueError, match=r"parts are the sizes of two or more unequal parts in lowest terms"):
            Shard(0, parts=bad)
    with pytest.raises(ValueError, match=r"with groups=1"):
        Shard(0, 2, (2, 1))


def _collectives(weights, dim: int) -> list[str]:
    """On every rank: each collective on a value held in `weights` parts along `dim`, against the whole."""
    n, r = dist.get_world_size(), dist.get_rank()
    x, p, plain = _value(weights, n, dim), Shard(dim, parts=weights), Shard(1 - dim)
    mine = comm.local_slice(x, p, r, n)
    wrong = []
    if not torch.equal(mine, _block(x, weights, dim, n, r)):
        wrong.append("local_slice")
    if not torch.equal(comm.all_gather(mine, p, None, n), x):
        wrong.append("all_gather")
    summand = x * (r + 1)  # partial sums adding up to x * n(n+1)/2
    if not torch.equal(comm.reduce_scatter(summand, p, None, n, r), comm.local_slice(x * (n * (n + 1) // 2), p, r, n)):
        wrong.append("reduce_scatter")
    other = comm.local_slice(x, plain, r, n)
    if not torch.equal(comm.all_to_all(other, plain, p, None, n, x.shape[plain.dim], r), mine):
        wrong.append("all_to_all plain -> parts")
    if not torch.equal(comm.all_to_all(mine, p, plain, None, n, x.shape[dim], r), other):
        wrong.append("all_to_all parts -> plain")
    padded = comm.local_pad(mine, p, r, n)
    dist.all_reduce(padded)
    if not torch.equal(padded, x):
        wrong.append("local_pad")
    return wrong


@pytest.mark.ranks
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("weights", [(2, 1, 1), (3, 1)])
@pytest.mark.parametrize("dim", [0, 1])
def test_collectives_on_a_value_held_in_parts_equal_the_whole(n, weights, dim):
    assert get_pool(n).run(_collectives, weights, dim) == [[]] * n
