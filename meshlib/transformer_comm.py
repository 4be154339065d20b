"""The collectives of a transformer's step, per microbatch and per step, and its model state per rank.

Bytes are each collective's payload per rank as `meshlib.predict` reads them (an all-gather's gathered
tensor, a reduce-scatter's input, an all-to-all's tensor, a send's message), in the dtype that moves. With
n = b·s/cp tokens on a rank and e bytes per element, per layer and microbatch:

- **Tensor parallelism** (Megatron): two all-reduces of n·h forward (after the output projection and the
  MLP) and two backward (the input gradients of the QKV and first MLP products). Sequence parallelism
  turns each forward one into an all-gather before and a reduce-scatter after; backward gathers the
  gradient before each row-parallel product, reduce-scatters the input gradient of each column-parallel
  one, and gathers their input again (Megatron keeps it split: Korthikanti et al. 2022's 34sbh/t). Under
  `tp_overlap="backward"` the column-parallel products' backward collectives run behind their
  products, as Megatron's asynchronous all-reduce does.
- **Context parallelism**: the ring sends a rank's K and V cp-1 times forward (behind the blocks), and K, V
  and their gradients cp-1 times each backward; the all-gather variant gathers K and V forward and again
  backward, and reduce-scatters their gradients; the all-to-all variant moves q, k, v and the output
  forward and their gradients backward.
- **Expert parallelism**: per MoE layer, the dispatch and the combine all-to-all of (tokens·top_k·h)
  forward, and their gradients backward.
- Block recompute runs the forward's collectives again (phase "recompute").
- **Per step**: the gradient all-reduce (ZeRO-0), or reduce-scatter and a gather of the updated
  parameters (ZeRO-1/2), or ZeRO-3's gathers before each microbatch's forward and backward, over the data
  ranks (dp×cp×ep outside the experts, dp×cp for them), in `reduce_dtype`; a tied embedding's gradient
  between the first and last pipeline stage.
"""

from __future__ import annotations

from .cost import zero_memory
from .transformer_work import ITEMSIZE, widths
from .workload import Comm

__all__ = ["model_state", "send_bytes", "stage_comm", "step_comm"]


def _tp(c, payload: float, phase: str, layers: int) -> list[Comm]:
    """One phase's tensor-parallel collectives for `layers` layers."""
    hidden_fwd = "compute" if c.tp_overlap == "all" else "none"
    hidden_bwd = "compute" if c.tp_overlap in ("backward", "all") else "none"
    k = 2 * layers
    if phase in ("forward", "recompute"):
        if not c.sp:
            return [Comm("all_reduce", ("tp",), payload, phase, k, hidden_fwd)]
        return [Comm("all_gather", ("tp",), payload, phase, k, hidden_fwd),
                Comm("reduce_scatter", ("tp",), payload, phase, k, hidden_fwd)]  # fmt: skip
    if not c.sp:
        return [Comm("all_reduce", ("tp",), payload, phase, k, hidden_bwd)]
    return [Comm("all_gather", ("tp",), payload, phase, k, hidden_fwd),
            Comm("reduce_scatter", ("tp",), payload, phase, k, hidden_bwd),
            Comm("all_gather", ("tp",), payload, phase, k, hidden_bwd)]  # fmt: skip


def _cp(shape, c, b: int, seq: int, layers: int) -> list[Comm]:
    e, n = ITEMSIZE[c.dtype], b * seq // c.cp
    q, k, v, o = widths(shape, c.tp)
    chunk = e * n * (k + v)
    if c.cp_method == "ring":
        return [Comm("send_recv", ("cp",), chunk, "forward", (c.cp - 1) * layers, "compute"),
                Comm("send_recv", ("cp",), chunk, "backward", 2 * (c.cp - 1) * layers, "compute")]  # fmt: skip
    if c.cp_method == "all-gather":
        return [Comm("all_gather", ("cp",), chunk * c.cp, "forward", layers),
                Comm("all_gather", ("cp",), chunk * c.cp, "backward", layers),
                Comm("reduce_scatter", ("cp",), chunk * c.cp, "backward", layers)]  # fmt: skip
    moved = e * n * (q + k + v + o)
    return [Comm("all_to_all", ("cp",), moved, phase, layers) for phase in ("forward", "backward")]


def stage_comm(shape, c, b: int, seq: int, dense: int, moe: int, *, embed: bool, head: bool) -> tuple[Comm, ...]:
    """The collectives one rank of this stage runs per microbatch."""
    e, layers = ITEMSIZE[c.dtype], dense + moe
    n = b * seq // c.cp
    out: list[Comm] = []
    if c.tp > 1:
        payload = e * n * shape.hidden
        for phase in ("forward", "backward") + (("recompute",) if c.recompute == "block" else ()):
            out += _tp(c, payload, phase, layers)
        if embed:
            out.append(Comm("reduce_scatter" if c.sp else "all_reduce", ("tp",), payload, "forward"))
        if head:
            out += [Comm("all_reduce", ("tp",), 4 * n, "forward", 3)]  # cross-entropy's max, sum and target
            out += [Comm("all_gather", ("tp",), payload, "forward"), Comm("reduce_scatter", ("tp",), payload,
                    "backward")] if c.sp else [Comm("all_reduce", ("tp",), payload, "backward")]  # fmt: skip
    if c.cp > 1 and layers:
        out += _cp(shape, c, b, seq, layers)
        if c.recompute == "block":
            out += [Comm(x.kind, x.axes, x.bytes, "recompute", x.count, x.overlap)
                    for x in _cp(shape, c, b, seq, layers) if x.phase == "forward"]  # fmt: skip
    if c.pp > 1 and not c.async_p2p:
        out += _p2p(shape, c, n, c.chunks)
    if c.ep > 1 and moe:
        tokens = n / c.tp if c.sp else n
        moved = e * tokens * shape.top_k * shape.hidden
        phases = ("forward", "backward") + (("recompute",) if c.recompute == "block" else ())
        out += [Comm("all_to_all", ("ep",), moved, phase, 2 * moe) for phase in phases]
    return tuple(out)


def _p2p(shape, c, n: int, v: int) -> list[Comm]:
    """Blocking pipeline exchanges: one per chunk and microbatch each way, and the receiver's gather of the
    split message over tp where sequence parallelism does not keep it split."""
    message = send_bytes(shape, c, n)
    out = [Comm("send_recv", ("pp",), message, phase, v) for phase in ("forward", "backward")]
    if c.tp > 1 and not c.sp:
        out += [Comm("all_gather", ("tp",), message * c.tp, phase, v) for phase in ("forward", "backward")]
    return out


def send_bytes(shape, c, n: int) -> float:
    """Activation bytes a stage sends on per microbatch: n·h, split over tp under sequence parallelism or
    where Megatron scatter-gathers the message across the tensor-parallel ranks (`async_p2p` False); else
    whole (torch's pipelining sends the replicated hidden state)."""
    return ITEMSIZE[c.dtype] * n * shape.hidden / (c.tp if c.sp or not c.async_p2p else 1)


def _axes(c, *names: str) -> tuple[str, ...]:
    return tuple(a for a in names if getattr(c, a) > 1)


def step_comm(params: tuple[float, float], c, m: int, *, tied: bool, embed_bytes: float) -> tuple[Comm, ...]:
    """Per-step gradient sync and ZeRO's gathers for a rank holding `params` (outside, inside the experts)."""
    g, e = ITEMSIZE[c.reduce_dtype], ITEMSIZE[c.dtype]
    overlaps = c.dp_overlap and c.zero != 1
    behind = "backward" if (overlaps and (c.pp == 1 or c.pp_dp_overlap)) or zero1_in_backward(c) else "none"
    prefetch = "forward" if overlaps or (c.zero == 1 and c.dp_overlap and c.zero1_overlap == "all") else "none"
    out: list[Comm] = []
    for count, axes in ((params[0], _axes(c, "dp", "cp", "ep")), (params[1], _axes(c, "dp", "cp"))):
        if not count or not axes:
            continue
        if c.zero == 0:
            out.append(Comm("all_reduce", axes, count * g, "backward", 1, behind))
            continue
        out.append(Comm("reduce_scatter", axes, count * g, "backward", 1, behind))
        if c.zero < 3:
            out.append(Comm("all_gather", axes, count * e, "forward", 1, prefetch))
        else:
            out += [Comm("all_gather", axes, count * e, phase, m, prefetch) for phase in ("forward", "backward")]
    if tied:
        out.append(Comm("send_recv", ("pp",), embed_bytes * g, "backward"))
    return tuple(out)


def zero1_in_backward(c) -> bool:
    """Whether ZeRO-1's reduce-scatters run behind backward (`StepConfig.zero1_overlap`): always with
    Megatron's distributed optimizer, and without a pipeline in meshlib's runtime."""
    overlap = c.zero1_overlap
    return c.zero == 1 and c.dp_overlap and (overlap == "all" or (overlap == "backward" and c.pp == 1))


def model_state(params: tuple[float, float], c) -> float:
    """Bytes of parameters, gradients and optimizer state per rank (`meshlib.cost.zero_memory`; gradients in
    `reduce_dtype`, from ZeRO-2 or with `main_grads`: Megatron's fp32 main gradients add 2 bytes a parameter
    to the ZeRO paper's 16). At ZeRO-3 PyTorch's FSDP keeps each parameter's fp32 shard alone and casts it
    to the compute dtype as it gathers (FSDP2's `MixedPrecisionPolicy`, FSDP1's flat parameter): no
    compute-dtype shard beside it, the ZeRO paper's 2/n bytes a parameter."""
    mixed = ITEMSIZE[c.dtype] < 4
    wide = mixed and (c.zero >= 2 or c.main_grads)  # gradients kept in reduce_dtype
    total = 0.0
    for count, n in ((params[0], c.dp * c.cp * c.ep), (params[1], c.dp * c.cp)):
        state = zero_memory(count, n, zero=c.zero, mixed=mixed, itemsize=4)
        extra = (ITEMSIZE[c.reduce_dtype] - ITEMSIZE[c.dtype]) * count / (n if c.zero >= 2 else 1) if wide else 0.0
        unkept = ITEMSIZE[c.dtype] * count / n if mixed and c.zero >= 3 else 0.0
        total += state.total + max(0.0, extra) - unkept
    return total
