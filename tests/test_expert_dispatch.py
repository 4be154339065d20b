"""Expert parallelism's per-shard code (`meshlib_torch.experts`) equals the one-process computation.

Method: random routings (distinct experts per token; some experts chosen by no token, or by the tokens
of some ranks only) run through `shard_map(experts_ep, ...)` on real gloo ranks (ep=2, ep=4, dp=2 x
ep=2 with the tokens over ("dp", "ep")), in fp64. The oracle is written here, independently: a plain
loop over tokens and their slots in one process (transformers v5 Mixtral experts' math), and torch
autograd of sum(y * ct) for the gradients of x, the routing weights and both expert tensors (the
shard_map boundary makes each whole; rank r's slice of an expert tensor is its experts' rows). Values
and gradients must agree to 1e-12. Each rank also reports what it read to the host (`experts.SYNCS`,
and a dispatch mode that sees every op that reads a value: `.item()`, `nonzero`, boolean masks,
`repeat_interleave` without its size), the bytes `COUNTER` counted per exchange (against the closed
form: rows sent to other ranks x H x itemsize), and whether a second run gave the same bits. Capacity
mode is checked against a one-process reference of its documented rule; the grouped GEMM against the
loop in fp32; the dry run (meta tensors, `spmd.region_collectives`) against the bytes it must record.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from meshlib import Mesh, P  # noqa: E402
from meshlib_torch.testing.pool import get_pool  # noqa: E402

pytestmark = pytest.mark.ranks

H, INNER, K, TOKENS = 6, 5, 2, 6  # hidden, intermediate, top-k, tokens per rank
MESHES = {"ep2": (Mesh(ep=2), "ep"), "ep4": (Mesh(ep=4), "ep"), "dp2-ep2": (Mesh(dp=2, ep=2), ("dp", "ep"))}


# -- problems and the one-process oracle -----------------------------------------------------------------
def problem(blocks: int, experts: int, seed: int, *, allowed=None, hidden: int = H, inner: int = INNER) -> dict:
    """Inputs for `blocks` ranks of TOKENS tokens: `allowed(block)` lists the experts its tokens may choose."""
    rng = np.random.default_rng(seed)
    index = np.stack([
        rng.choice(allowed(t // TOKENS) if allowed else np.arange(experts), size=K, replace=False)
        for t in range(blocks * TOKENS)
    ])  # fmt: skip
    return {
        "x": rng.standard_normal((blocks * TOKENS, hidden)), "index": index,
        "weights": rng.random((blocks * TOKENS, K)), "gate_up": rng.standard_normal((experts, 2 * inner, hidden)),
        "down": rng.standard_normal((experts, hidden, inner)),
    }  # fmt: skip


def reference(p: dict, ct, keep=None) -> dict:
    """y and the gradients of sum(y * ct), one token and one slot at a time (`keep[t, j]` False: dropped)."""
    x, w, gu, down = (torch.tensor(p[n], requires_grad=True) for n in ("x", "weights", "gate_up", "down"))
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(K):
            if keep is not None and not keep[t, j]:
                continue
            e = int(p["index"][t, j])
            gate, up = (gu[e] @ x[t]).chunk(2)
            acc = acc + w[t, j] * (down[e] @ (F.silu(gate) * up))
        rows.append(acc)
    y = torch.stack(rows)
    (y * torch.tensor(ct)).sum().backward()
    return {"y": y.detach().numpy(), "x": x.grad.numpy(), "weights": w.grad.numpy(), "gate_up": gu.grad.numpy(),
            "down": down.grad.numpy()}  # fmt: skip


def capacity_keep(index, blocks: int, experts: int, factor: float):
    """The documented rule, per rank's block of tokens: each expert keeps the first C pairs in (token, slot) order."""
    cap = math.ceil(factor * TOKENS * K / experts)
    keep = np.zeros(index.shape, dtype=bool)
    for b in range(blocks):
        taken = dict.fromkeys(range(experts), 0)
        for t in range(b * TOKENS, (b + 1) * TOKENS):
            for j in range(K):
                e = int(index[t, j])
                keep[t, j] = taken[e] < cap
                taken[e] += 1
    return keep


# -- rank jobs --------------------------------------------------------------------------------------------
_READS = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique_consecutive", "_unique", "_unique2"}


def _value_reads():
    from meshlib_torch.torch_private import TorchDispatchMode

    class Reads(TorchDispatchMode):
        """Every op that reads a tensor's values to the host (or would sync a GPU) while it is entered."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in _READS or (name == "repeat_interleave" and kwargs.get("output_size") is None):
                self.seen.append(str(func))
            return func(*args, **kwargs)

    return Reads()


def experts_job(
    mesh, data, p: dict, ct, capacity_factor=None, layers: int = 1, dtype: str = "float64", check_vma: bool = True
) -> dict:
    """experts_ep under shard_map (run twice), and what the rank counted: syncs, reads, bytes per exchange."""
    from meshlib_torch import COUNTER, shard_map
    from meshlib_torch.experts import SYNCS, capacity_dropped, experts_ep, tokens_per_expert

    experts = p["gate_up"].shape[0]
    layer = functools.partial(experts_ep, capacity_factor=capacity_factor)

    def f(x, index, weights, gate_up, down):
        for _ in range(layers):
            x = layer(x, index, weights, gate_up, down)
        return x

    specs = dict(mesh=mesh, in_specs=(P(data), P(data), P(data), P("ep"), P("ep")), out_specs=P(data), check_vma=check_vma)
    runs = []
    for _ in range(2):
        args = [torch.tensor(p[n]) for n in ("x", "index", "weights", "gate_up", "down")]
        args = [a.to(getattr(torch, dtype)).requires_grad_() if a.is_floating_point() else a for a in args]
        COUNTER.reset()
        SYNCS.reset()
        with _value_reads() as reads:
            y = shard_map(f, **specs)(*args).full_tensor()
            forward = dict(SYNCS.by_phase)
            (y * torch.tensor(ct, dtype=y.dtype)).sum().backward()
        runs.append({"y": y.detach(), **{n: a.grad for n, a in zip(("x", "_", "weights", "gate_up", "down"), args)}})
    out = {k: v.numpy() for k, v in runs[0].items() if v is not None}
    out["same bits"] = all(torch.equal(a, b) for k, a in runs[0].items() if a is not None for b in [runs[1][k]])
    out["syncs"] = {"forward": forward, "after backward": dict(SYNCS.by_phase)}
    out["reads"] = reads.seen
    out["bytes"] = _bytes(COUNTER.by_source)
    index = torch.tensor(p["index"])
    stats = shard_map(functools.partial(tokens_per_expert, num_experts=experts, axis_name=data), mesh=mesh,
                      in_specs=P(data), out_specs=P())(index)  # fmt: skip
    out["tokens per expert"] = stats.full_tensor().numpy()
    if capacity_factor is not None:
        drops = functools.partial(capacity_dropped, num_experts=experts, capacity_factor=capacity_factor)
        out["dropped"] = shard_map(drops, mesh=mesh, in_specs=P(data), out_specs=P(data))(index).full_tensor().numpy()
    return out


def _bytes(counted: dict) -> dict:
    """{(phase, op): [bytes of each call site]}: the experts' exchanges, as COUNTER counted them."""
    out: dict = {}
    for (phase, _, _, where), b in counted.items():
        op, line = where.split("@")
        if op in ("all_to_all_v", "all_to_all") and line.startswith("dispatch.py"):
            out.setdefault((phase, op), []).append(b)
    return out


def exchange_job(mesh, axis, x, send, ct, pad: int) -> dict:
    """lax.all_to_all_v alone: the rank at index i along `axis` sends `send[i][j]` rows of its block of x to
    index j (its first rows, in order), and returns what it received padded to `pad` rows."""
    import torch.distributed as dist

    from meshlib_torch import COUNTER, lax, shard_map

    me = mesh.axis_coord(dist.get_rank(), axis)

    def f(block):
        got = lax.all_to_all_v(block[: sum(send[me])], axis, send[me], [s[me] for s in send])
        return torch.cat([got, got.new_zeros((pad - got.shape[0], got.shape[1]))])

    xs = torch.tensor(x, requires_grad=True)
    COUNTER.reset()
    y = shard_map(f, mesh=mesh, in_specs=P(axis), out_specs=P(axis))(xs).full_tensor()
    counted = {w.split("@")[0]: b for (_, k, _, w), b in COUNTER.by_source.items() if k == "all_to_all"}
    (y * torch.tensor(ct)).sum().backward()
    return {"y": y.detach().numpy(), "grad": xs.grad.numpy(), "bytes": counted}


def exchange_reference(x, send, ct, pad: int):
    """What index i receives: from each j in index order, the rows of j's block that j sends it; padded."""
    n = len(send)
    xs = torch.tensor(x, requires_grad=True)
    blocks = xs.split(x.shape[0] // n)
    outs = []
    for i in range(n):
        got = [blocks[j][sum(send[j][:i]) : sum(send[j][: i + 1])] for j in range(n)]
        got.append(xs.new_zeros((pad - sum(send[j][i] for j in range(n)), x.shape[1])))
        outs.append(torch.cat(got))
    y = torch.cat(outs)
    (y * torch.tensor(ct)).sum().backward()
    return y.detach().numpy(), xs.grad.numpy()


# -- the tests --------------------------------------------------------------------------------------------
EXPERTS = 8


def _layout(mesh, data):
    """(blocks of tokens, ep, each rank's (block, ep index, its ep group's ranks))."""
    data = data if isinstance(data, tuple) else (data,)
    blocks = math.prod(mesh.axis_size(a) for a in data)
    where = [(mesh.axis_coord(r, data), mesh.axis_coord(r, "ep"), mesh.group(r, ("ep",))) for r in range(mesh.size)]
    return blocks, mesh.axis_size("ep"), where


def _leaving(p: dict, mesh, data) -> list[tuple[int, int]]:
    """Per rank: (pairs it sends to other ranks' experts, pairs other ranks send to its experts)."""
    blocks, ep, where = _layout(mesh, data)
    owner = p["index"] // (EXPERTS // ep)
    block = lambda b: owner[b * TOKENS : (b + 1) * TOKENS]
    out = []
    for b, me, group in where:
        others = [where[r][0] for r in group if where[r][0] != b]
        out.append((int((block(b) != me).sum()), sum(int((block(o) == me).sum()) for o in others)))
    return out


def _assert_equal(got: dict, want: dict, where: str, tol: float = 1e-12) -> None:
    for name in ("y", "x", "weights", "gate_up", "down"):
        np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol, err_msg=f"{where}: {name}")


def _run(name, p, ct, **kw):
    mesh, data = MESHES[name]
    return mesh, data, get_pool(mesh.size).run(experts_job, mesh, data, p, ct, **kw)


@pytest.mark.parametrize("name, check_vma", [*((n, True) for n in MESHES), ("dp2-ep2", False)])
def test_dropless_equals_one_process(name, check_vma):
    """Values and the four gradients (typed, and untyped: check_vma=False); one host read in forward, none in
    backward; bytes per exchange; router statistics."""
    mesh, data = MESHES[name]
    p = problem(_layout(mesh, data)[0], EXPERTS, seed=1)
    ct = np.random.default_rng(2).standard_normal(p["x"].shape)
    _, _, ranks = _run(name, p, ct, check_vma=check_vma)
    want = reference(p, ct)
    for rank, (got, (sent, arriving)) in enumerate(zip(ranks, _leaving(p, mesh, data))):
        _assert_equal(got, want, f"{name} rank {rank}")
        assert got["syncs"] == {"forward": {"forward": 1}, "after backward": {"forward": 1}}
        assert got["reads"] == []
        row = H * 8
        assert sorted(got["bytes"][("forward", "all_to_all_v")]) == sorted([sent * row, arriving * row])
        assert sorted(got["bytes"][("backward", "all_to_all_v")]) == sorted([sent * row, arriving * row])
        assert got["bytes"][("forward", "all_to_all")] == [EXPERTS * 8]  # the counts, int64
        assert ("backward", "all_to_all") not in got["bytes"]
        np.testing.assert_array_equal(got["tokens per expert"], np.bincount(p["index"].ravel(), minlength=EXPERTS))


@pytest.mark.parametrize("name", ["ep4", "dp2-ep2"])
def test_experts_that_get_no_tokens(name):
    """Expert 3 and rank 3's experts (6, 7; on ep=4 that rank receives no row) are chosen by no token; expert 5
    only by the first block's tokens, expert 0 by the second's: values and gradients still equal, and an
    expert without tokens gets an exact zero gradient."""
    mesh, data = MESHES[name]
    blocks = _layout(mesh, data)[0]

    def allowed(b):
        return [e for e in range(EXPERTS) if e not in (3, 6, 7) and (e != 5 or b == 0) and (e != 0 or b == 1)]

    p = problem(blocks, EXPERTS, seed=3, allowed=allowed)
    ct = np.random.default_rng(4).standard_normal(p["x"].shape)
    _, _, ranks = _run(name, p, ct)
    want = reference(p, ct)
    for rank, got in enumerate(ranks):
        _assert_equal(got, want, f"{name} rank {rank}")
        for e in (3, 6, 7):
            assert not got["gate_up"][e].any() and not got["down"][e].any(), f"expert {e} on rank {rank}"


def _balanced(blocks: int, ep: int) -> dict:
    """Each rank routes T*k/ep pairs to every rank's experts: pair (t, j) to rank (t*k + j) % ep."""
    p = problem(blocks, EXPERTS, seed=5)
    local = EXPERTS // ep
    t, j = np.meshgrid(np.arange(blocks * TOKENS), np.arange(K), indexing="ij")
    p["index"] = ((t * K + j) % ep) * local + t % local
    return p


@pytest.mark.parametrize("name", ["ep4", "dp2-ep2"])
def test_one_host_read_per_layer_and_the_bytes_of_balanced_routing(name):
    """Two layers: two host reads in forward, none in backward, no other op that reads a value; each of the
    four exchanges per layer moves T*k*H*bytes*(ep-1)/ep per rank under balanced routing."""
    mesh, data = MESHES[name]
    blocks, ep, _ = _layout(mesh, data)
    p = _balanced(blocks, ep)
    _, _, ranks = _run(name, p, np.ones(p["x"].shape), layers=2)
    each = TOKENS * K * H * 8 * (ep - 1) // ep
    for got in ranks:
        assert got["syncs"] == {"forward": {"forward": 2}, "after backward": {"forward": 2}}
        assert got["reads"] == []
        assert got["bytes"][("forward", "all_to_all_v")] == [2 * each, 2 * each]  # dispatch, combine: 2 layers
        assert got["bytes"][("backward", "all_to_all_v")] == [2 * each, 2 * each]


def test_same_inputs_give_the_same_bits():
    p = problem(4, EXPERTS, seed=6)
    ct = np.random.default_rng(7).standard_normal(p["x"].shape)
    _, _, ranks = _run("ep4", p, ct)
    assert all(got["same bits"] for got in ranks)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("name", ["ep4", "dp2-ep2"])
def test_capacity_mode_drops_what_its_rule_says(name, factor):
    """Each expert keeps the first C = ceil(c*T*k/E) pairs of each rank in (token, slot) order: the dropped
    pairs and the output equal a one-process reference of that rule; nothing is read to the host; the
    exchanges are fixed-size all-to-alls of E*C rows."""
    mesh, data = MESHES[name]
    blocks = _layout(mesh, data)[0]
    p = problem(blocks, EXPERTS, seed=8, allowed=lambda b: [0, 1, 2, 4, 5] if b % 2 else list(range(EXPERTS)))
    ct = np.random.default_rng(9).standard_normal(p["x"].shape)
    _, _, ranks = _run(name, p, ct, capacity_factor=factor)
    keep = capacity_keep(p["index"], blocks, EXPERTS, factor)
    want = reference(p, ct, keep)
    cap = math.ceil(factor * TOKENS * K / EXPERTS)
    assert factor == 1.5 or (~keep).sum() > 0  # the problem does drop pairs
    for rank, got in enumerate(ranks):
        np.testing.assert_array_equal(got["dropped"], ~keep)
        _assert_equal(got, want, f"{name} c={factor} rank {rank}")
        assert got["syncs"] == {"forward": {}, "after backward": {}} and got["reads"] == []
        assert got["bytes"][("forward", "all_to_all")] == [EXPERTS * cap * H * 8] * 2
        assert got["bytes"][("backward", "all_to_all")] == [EXPERTS * cap * H * 8] * 2


def test_the_grouped_gemm_equals_the_loop():
    """fp32, groups of 3, 0, 5 and 2 rows: values and gradients of rows and both expert tensors, to 1e-5."""
    from meshlib_torch.experts import expert_mlp, grouped_gemm_runs

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(10, 8, generator=gen), torch.randn(4, 8, 8, generator=gen), torch.randn(4, 8, 4, generator=gen)]
    if not grouped_gemm_runs(*inputs):
        pytest.skip(f"torch {torch.__version__} has no grouped GEMM kernel for fp32 on CPU")
    results = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = expert_mlp(leaves[0], [3, 0, 5, 2], *leaves[1:], grouped=grouped)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not results[0][2][1].any() and not results[0][3][1].any()  # the expert without rows
    assert not grouped_gemm_runs(*(t.double() for t in inputs))  # fp64: the loop
    assert not grouped_gemm_runs(inputs[0][:, :6], inputs[1][..., :6], inputs[2][:, :6])  # 24-byte rows
    with pytest.raises(ValueError, match="grouped=True"):
        expert_mlp(inputs[0].double(), [3, 0, 5, 2], inputs[1].double(), inputs[2].double(), grouped=True)


def test_fp32_layers_take_the_grouped_gemm_and_equal_fp64():
    """ep=4, H=8, I=4 in fp32 (the grouped GEMM's path on CPU) against the fp64 oracle, to 1e-5."""
    from meshlib_torch.experts import grouped_gemm_runs

    p = problem(4, EXPERTS, seed=10, hidden=8, inner=4)
    local = [torch.zeros(5, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 4)]
    if not grouped_gemm_runs(*local):
        pytest.skip(f"torch {torch.__version__} has no grouped GEMM kernel for fp32 on CPU")
    ct = np.random.default_rng(11).standard_normal(p["x"].shape)
    _, _, ranks = _run("ep4", p, ct, dtype="float32")
    want = reference(p, ct)
    for rank, got in enumerate(ranks):
        _assert_equal(got, want, f"fp32 rank {rank}", tol=1e-5)


@pytest.mark.parametrize("factor", [None, 1.0])
@pytest.mark.parametrize("name", ["ep4", "dp2-ep2"])
def test_a_dry_run_records_the_exchanges_and_reads_nothing(name, factor):
    """On meta tensors of one rank's shards: the counts' all-to-all (exact), then each all_to_all_v priced
    as balanced routing, T*k*(ep-1)/ep rows of H*8 bytes (or capacity mode's exact all-to-alls), forward and
    backward; the expert weights' gradients summed over dp once each; the host read of dropless dispatch
    recorded (the plan lists it) but not made."""
    from meshlib.tree import ShapeDtype
    from meshlib_torch.experts import SYNCS, experts_ep
    from meshlib_torch.spmd import region_collectives

    mesh, data = MESHES[name]
    ep, local = mesh.axis_size("ep"), EXPERTS // mesh.axis_size("ep")
    args = (ShapeDtype((TOKENS, H), "float64"), ShapeDtype((TOKENS, K), "int64"), ShapeDtype((TOKENS, K), "float64"),
            ShapeDtype((local, 2 * INNER, H), "float64"), ShapeDtype((local, H, INNER), "float64"))  # fmt: skip
    SYNCS.reset()
    plan = region_collectives(
        functools.partial(experts_ep, capacity_factor=factor), mesh=mesh,
        in_specs=(P(data), P(data), P(data), P("ep"), P("ep")), out_specs=P(data), args=args,
    )  # fmt: skip
    got = [(r.phase, r.op, r.axes, r.bytes, r.priced) for r in plan.records]
    if factor is None:
        rows = TOKENS * K * (ep - 1) // ep
        v = lambda phase: (phase, "all_to_all_v", ("ep",), rows * H * 8, "expected")
        read = ("forward", "host_read", (), 2 * EXPERTS * 8, "exact")  # recorded, not made: the counts' bytes
        want = [("forward", "all_to_all", ("ep",), EXPERTS * 8, "exact"), read, v("forward"), v("forward")]
        want += [v("backward"), v("backward")]
    else:
        a = lambda phase: (phase, "all_to_all", ("ep",), EXPERTS * math.ceil(TOKENS * K / EXPERTS) * H * 8, "exact")
        want = [a("forward"), a("forward"), a("backward"), a("backward")]
    if "dp" in mesh.axis_names:  # the expert weights are invariant over dp: one psum of each gradient
        want += [("backward", "pcast", ("dp",), local * H * INNER * 8, "exact")]
        want += [("backward", "pcast", ("dp",), local * 2 * INNER * H * 8, "exact")]
    assert got == want
    assert SYNCS.count == 0 and plan.outputs.shape == (TOKENS, H)


@pytest.mark.parametrize("mesh, axis", [(Mesh(ep=4), "ep"), (Mesh(a=2, b=3), ("b", "a"))], ids=["ep", "b-major"])
def test_all_to_all_v_equals_its_reference(mesh, axis):
    """Blocks of uneven sizes (empty ones, a rank sending nothing, one sending to itself only), values and
    gradients, over one axis and over two named out of mesh order (their indices are not the group's ranks
    and not a mere swap of them); the bytes counted are the rows sent to other ranks."""
    n, rows = mesh.size, 12
    rng = np.random.default_rng(12)
    send = rng.integers(0, 3, (n, n)) * (rng.random((n, n)) < 0.7)
    send[1], send[2] = 0, np.eye(n, dtype=int)[2] * 5  # index 1 sends nothing, 2 only to itself
    send = send.tolist()
    pad = max(sum(s[i] for s in send) for i in range(n))
    x, ct = rng.standard_normal((n * rows, 3)), rng.standard_normal((n * pad, 3))
    want, grad = exchange_reference(x, send, ct, pad)
    ranks = get_pool(n).run(exchange_job, mesh, axis, x, send, ct, pad)
    for rank, got in enumerate(ranks):
        me = mesh.axis_coord(rank, axis)
        np.testing.assert_array_equal(got["y"], want)
        np.testing.assert_allclose(got["grad"], grad, rtol=1e-12, atol=1e-12)
        assert got["bytes"] == {"all_to_all_v": (sum(send[me]) - send[me][me]) * 3 * 8}


def test_all_to_all_v_takes_host_counts_that_add_up():
    from meshlib.tree import ShapeDtype
    from meshlib_torch import lax
    from meshlib_torch.spmd import region_collectives

    def plan(send, recv):
        f = lambda x: lax.all_to_all_v(x, "ep", send, recv)
        return region_collectives(f, mesh=Mesh(ep=2), in_specs=P("ep"), out_specs=P("ep"), args=(ShapeDtype((4, 3)),))

    assert [(r.phase, r.bytes, r.priced) for r in plan([1, 3], [2, 2]).records] == [
        ("forward", 4 * 3 * 4, "bound"), ("backward", 4 * 3 * 4, "bound"),
    ]  # fmt: skip
    with pytest.raises(TypeError, match="Python ints"):
        plan(torch.tensor([1, 3]), [2, 2])
    with pytest.raises(ValueError, match="sum to 3"):
        plan([1, 2], [2, 2])
    with pytest.raises(ValueError, match="2 non-negative ints"):
        plan([4], [2, 2])
