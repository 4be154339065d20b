"""Context parallelism's per-shard attention (`meshlib_torch.attention`) equals one-process attention.

Method: random q, k, v (B=2, S=16, D=4, 4 query heads and 4 or 2 key/value heads), masks and packed
documents run through `shard_map(ring_attention | allgather_attention | ulysses_attention, ...)` on real gloo
ranks (cp=2, cp=4, and dp=2 x cp=2 with the batch over dp), in fp64, the sequence split over cp in the
contiguous or the zigzag layout (then reordered with `to_zigzag` before the call and back with `from_zigzag`
after it, so the gradients arrive in token order). One pool job per mesh runs every case. The oracle is
`torch.nn.functional.scaled_dot_product_attention` on the whole sequence in this process (enable_gqa, one
mask combining causal, documents and the user's mask), and autograd of sum(y * ct) for the gradients of q, k
and v: values and gradients agree to 1e-12. Each rank also reports what `COUNTER` counted at the attention's
own call sites (bytes per phase and kind, checked against the closed forms written in `_bytes_expected`) and
what `SCORES` counted (the (query chunk, key chunk) pairs computed and their FLOPs, checked against
`attention_flops_per_rank`). Bad arguments are checked on meta tensors (`region_collectives`, no ranks): each
error names what is wrong and the fix, before any collective.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from meshlib import Mesh, P  # noqa: E402
from meshlib_torch.testing.pool import get_pool  # noqa: E402

pytestmark = pytest.mark.ranks

B, S, D, HQ = 2, 16, 4, 4
MESHES = {"cp2": Mesh(cp=2), "cp4": Mesh(cp=4), "dp2-cp2": Mesh(dp=2, cp=2)}
ATTENTION_FILES = ("ring.py", "allgather.py", "ulysses.py", "local.py", "inputs.py")


@dataclass(frozen=True)
class Case:
    variant: str  # ring | allgather | ulysses
    causal: bool
    layout: str
    kv_heads: int = HQ
    mask: str | None = None  # bool2: (S, S) bool | bool4: (B, 1, S, S) bool | float4: (B, Hq, S, S) additive
    docs: bool = False
    dtype: str = "float64"

    @property
    def name(self) -> str:
        parts = [self.variant, "causal" if self.causal else "full", self.layout, f"kv{self.kv_heads}"]
        parts += ([self.mask] if self.mask else []) + (["docs"] if self.docs else [])
        return "-".join(parts + ([self.dtype] if self.dtype != "float64" else []))

    @property
    def itemsize(self) -> int:
        return 8 if self.dtype == "float64" else 4


def cases(mesh_name: str) -> list[Case]:
    """The cases each mesh runs; Ulysses with 2 key/value heads only where cp divides them (cp4: `test_ulysses_
    refuses_kv_heads_cp_does_not_divide`)."""
    cp = MESHES[mesh_name].axis_size("cp")
    ulysses_kv = 2 if cp == 2 else HQ
    return [
        Case("ring", True, "zigzag"),
        Case("ring", True, "contiguous"),
        Case("ring", False, "contiguous", kv_heads=2),
        Case("ring", True, "zigzag", kv_heads=2),
        Case("ring", False, "zigzag", kv_heads=2, mask="float4"),
        Case("ring", True, "contiguous", kv_heads=2, mask="bool2"),
        Case("ring", True, "zigzag", kv_heads=2, docs=True),
        Case("ring", False, "contiguous", mask="bool4", docs=True),
        Case("ring", True, "zigzag", kv_heads=1, mask="float4", docs=True),
        Case("ring", True, "zigzag", kv_heads=2, mask="float4", docs=True, dtype="float32"),
        Case("allgather", True, "zigzag", kv_heads=2),
        Case("allgather", True, "contiguous", docs=True),
        Case("allgather", False, "zigzag", kv_heads=2, mask="float4"),
        Case("allgather", True, "contiguous", kv_heads=2, mask="bool2", docs=True),
        Case("ulysses", True, "zigzag", kv_heads=ulysses_kv),
        Case("ulysses", False, "contiguous", kv_heads=ulysses_kv, mask="float4"),
        Case("ulysses", True, "contiguous", kv_heads=ulysses_kv, mask="bool2", docs=True),
        Case("ulysses", True, "zigzag", kv_heads=ulysses_kv, mask="bool4", docs=True),
    ]


# -- problems and the one-process oracle -----------------------------------------------------------------
def problem(kv_heads: int, seed: int) -> dict:
    """q, k, v, the output's cotangent, the three masks and the documents, in token order (numpy, fp64)."""
    rng = np.random.default_rng(seed)
    bool2 = rng.random((S, S)) < 0.6
    bool4 = rng.random((B, 1, S, S)) < 0.6
    bool2[np.arange(S), np.arange(S)] = bool4[:, :, np.arange(S), np.arange(S)] = True  # no query sees nothing
    cuts = [np.sort(rng.choice(np.arange(1, S), size=3, replace=False)) for _ in range(B)]
    docs = np.stack([np.searchsorted(c, np.arange(S), side="right") for c in cuts])  # 4 documents per row
    return {
        "q": rng.standard_normal((B, HQ, S, D)), "k": rng.standard_normal((B, kv_heads, S, D)),
        "v": rng.standard_normal((B, kv_heads, S, D)), "ct": rng.standard_normal((B, HQ, S, D)),
        "bool2": bool2, "bool4": bool4, "float4": rng.standard_normal((B, HQ, S, S)), "docs": docs,
    }  # fmt: skip


def reference(p: dict, case: Case) -> dict:
    """y and the gradients of sum(y * ct) by SDPA on the whole sequence, in this process."""
    q, k, v = (torch.tensor(p[n], requires_grad=True) for n in ("q", "k", "v"))
    allowed = torch.ones(S, S, dtype=torch.bool)
    if case.causal:
        allowed = allowed.tril()
    if case.docs:
        docs = torch.tensor(p["docs"])
        allowed = allowed & (docs[:, :, None] == docs[:, None, :])[:, None]
    if case.mask and case.mask.startswith("bool"):
        allowed = allowed & torch.tensor(p[case.mask])
    attn = allowed
    if case.mask == "float4":
        attn = torch.tensor(p["float4"]).masked_fill(~allowed, float("-inf"))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, enable_gqa=True)
    (y * torch.tensor(p["ct"])).sum().backward()
    return {"y": y.detach().numpy(), "q": q.grad.numpy(), "k": k.grad.numpy(), "v": v.grad.numpy()}


# -- rank jobs --------------------------------------------------------------------------------------------
def attention_job(mesh, case_list: list, problems: dict) -> list[dict]:
    """Every case on this rank: whole results and gradients in token order, the attention's bytes per
    (phase, kind), and the score blocks it computed."""
    return [_run_case(mesh, case, problems[case.kv_heads]) for case in case_list]


def _run_case(mesh, case: Case, p: dict) -> dict:
    from meshlib_torch import COUNTER, attention, shard_map
    from meshlib_torch.attention import SCORES, from_zigzag, to_zigzag

    fn = getattr(attention, f"{case.variant}_attention")
    cp, data = mesh.axis_size("cp"), ("dp" if "dp" in mesh.axis_names else None)
    zig = case.layout == "zigzag"
    order = (lambda x, dim: to_zigzag(x, cp, dim)) if zig else (lambda x, dim: x)
    dtype = getattr(torch, case.dtype)
    leaves = [torch.tensor(p[n]).to(dtype).requires_grad_() for n in ("q", "k", "v")]
    args, specs, extra = [order(t, 2) for t in leaves], [P(data, None, "cp")] * 3, []
    if case.mask:
        m = torch.tensor(p[case.mask])
        m = m if m.dtype == torch.bool else m.to(dtype)
        args.append(order(order(m, -2), -1))
        specs.append(P("cp", None) if m.dim() == 2 else P(data if m.shape[0] == B else None, None, "cp", None))
        extra.append("mask")
    if case.docs:
        args.append(order(torch.tensor(p["docs"]), 1))
        specs.append(P(data, "cp"))
        extra.append("doc_ids")
    call = functools.partial(fn, causal=case.causal, layout=case.layout)

    def f(q, k, v, *rest):
        return call(q, k, v, **dict(zip(extra, rest)))

    COUNTER.reset()
    SCORES.reset()
    try:
        y = shard_map(f, mesh=mesh, in_specs=tuple(specs), out_specs=P(data, None, "cp"))(*args).full_tensor()
    except ValueError as err:
        return {"error": str(err), "bytes": dict(COUNTER.by_kind)}
    scores = {"pairs": SCORES.pairs, "flops": SCORES.flops}
    y = from_zigzag(y, cp, 2) if zig else y
    (y * torch.tensor(p["ct"]).to(dtype)).sum().backward()
    return {
        "y": y.detach().numpy(), **{n: t.grad.numpy() for n, t in zip("qkv", leaves)}, "scores": scores,
        "bytes": _attention_bytes(COUNTER.by_source), "rank": torch.distributed.get_rank(),
    }  # fmt: skip


def _attention_bytes(counted: dict) -> dict:
    """{(phase, kind): bytes} of the collectives called in the attention package (the shard_map boundary's
    own, at the test's line, left out)."""
    out: dict = {}
    for (phase, kind, _, where), b in counted.items():
        if where.split("@")[1].split(":")[0] in ATTENTION_FILES:
            out[(phase, kind)] = out.get((phase, kind), 0) + b
    return out


@functools.cache
def results(mesh_name: str) -> dict:
    """{case: [each rank's result]}, from one pool job for the mesh."""
    mesh = MESHES[mesh_name]
    case_list = cases(mesh_name)
    problems = {h: problem(h, seed=h) for h in {c.kv_heads for c in case_list}}
    ranks = get_pool(mesh.size).run(attention_job, mesh, case_list, problems)
    return {"problems": problems, **{c: [r[i] for r in ranks] for i, c in enumerate(case_list)}}


# -- closed forms -----------------------------------------------------------------------------------------
def _bytes_expected(case: Case, mesh) -> dict:
    """Logical bytes per rank at the attention's call sites, L = S/cp tokens per rank, 8 bytes an element in
    fp64 (4 in fp32):
    ring: forward (cp-1) hops of K and V stacked, 2*B*Hkv*L*D*8 each ('send_recv'); backward K and V go
    around again, (cp-2) hops (a rank keeps the last shard that reached it and has its own), with their
    gradient, (cp-1) hops of the same size in the compute dtype (here the inputs'); allgather: an all-gather of 2*B*Hkv*S*D*8 (its output), backward a reduce-scatter of it;
    ulysses: all-to-alls of q (B*Hq*L*D*8), k and v (2*B*Hkv*L*D*8) and the output (B*Hq*L*D*8), each again in
    backward. Documents: an all-gather of B*S int64 (forward only). Ulysses' mask: its rows for every query,
    a per-head mask by all-to-all (B*Hq*L*S*8 in), a shared one by all-gather (its output, S*S per batch row
    it has, 1 byte a bool)."""
    cp = mesh.axis_size("cp")
    b = B // (mesh.axis_size("dp") if "dp" in mesh.axis_names else 1)
    length, hkv = S // cp, case.kv_heads
    item = case.itemsize
    kv = 2 * b * hkv * length * D * item
    out: dict = {}
    add = lambda key, n: out.__setitem__(key, out.get(key, 0) + n)
    if case.variant == "ring" and cp > 1:
        add(("forward", "send_recv"), (cp - 1) * kv)
        add(("backward", "send_recv"), (cp - 2) * kv + (cp - 1) * kv)
    if case.variant == "allgather":
        add(("forward", "all_gather"), cp * kv)
        add(("backward", "reduce_scatter"), cp * kv)
    if case.variant == "ulysses":
        moved = 2 * b * HQ * length * D * item + kv
        add(("forward", "all_to_all"), moved)
        add(("backward", "all_to_all"), moved)
        if case.mask == "float4":
            add(("forward", "all_to_all"), b * HQ * length * S * item)
        elif case.mask == "bool2":
            add(("forward", "all_gather"), S * S * 1)
        elif case.mask == "bool4":
            add(("forward", "all_gather"), b * S * S * 1)
    if case.docs:
        add(("forward", "all_gather"), b * S * 8)
    return out


def _assert_equal(got: dict, want: dict, where: str, tol: float = 1e-12) -> None:
    for name in ("y", "q", "k", "v"):
        np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol, err_msg=f"{where}: {name}")


def _cp_index(mesh, rank: int) -> int:
    return mesh.axis_coord(rank, "cp")


# -- the tests --------------------------------------------------------------------------------------------
ALL = [(m, c) for m in MESHES for c in cases(m)]


@pytest.mark.parametrize("mesh_name, case", ALL, ids=[f"{m}-{c.name}" for m, c in ALL])
def test_equals_one_process_attention(mesh_name, case):
    """Values and the gradients of q, k and v on every rank equal SDPA's on the whole sequence in fp64, to 1e-12
    (fp32 inputs, scores and merges in fp32: to 1e-5)."""
    got = results(mesh_name)
    want = reference(got["problems"][case.kv_heads], case)
    tol = 1e-12 if case.dtype == "float64" else 1e-5
    for rank, r in enumerate(got[case]):
        assert "error" not in r, r.get("error")
        _assert_equal(r, want, f"{mesh_name} {case.name} rank {rank}", tol=tol)


@pytest.mark.parametrize("mesh_name, case", ALL, ids=[f"{m}-{c.name}" for m, c in ALL])
def test_bytes_moved_per_rank(mesh_name, case):
    """The bytes COUNTER counted at the attention's call sites equal the closed form (`_bytes_expected`)."""
    mesh = MESHES[mesh_name]
    for r in results(mesh_name)[case]:
        assert r["bytes"] == _bytes_expected(case, mesh), f"rank {r['rank']}"


RING = [(m, c) for m, c in ALL if c.variant in ("ring", "allgather")]


@pytest.mark.parametrize("mesh_name, case", RING, ids=[f"{m}-{c.name}" for m, c in RING])
def test_score_blocks_computed_equal_the_closed_form(mesh_name, case):
    """The (query chunk, key chunk) pairs each rank computed, and their FLOPs, equal `attention_flops_per_rank`
    (causal: fully masked pairs skipped; masks and documents skip nothing: they are data)."""
    from meshlib_torch.attention import attention_flops_per_rank

    mesh = MESHES[mesh_name]
    cp = mesh.axis_size("cp")
    b = B // (mesh.axis_size("dp") if "dp" in mesh.axis_names else 1)
    closed = attention_flops_per_rank(S, cp, HQ, D, causal=case.causal, layout=case.layout)
    chunk = S // cp // (2 if case.layout == "zigzag" else 1)
    for r in results(mesh_name)[case]:
        i = _cp_index(mesh, r["rank"])
        assert r["scores"]["flops"] == b * closed[i]
        assert r["scores"]["pairs"] == closed[i] // (4 * HQ * D * chunk**2)


def test_zigzag_balances_causal_work():
    """cp=4, causal: measured per-rank FLOPs (ring) with zigzag differ by less than 1/cp of their mean (here:
    not at all, 2cp+1 = 9 pairs of (S/2cp)² each); contiguous, rank i computes i+1 blocks of (S/cp)², so the
    last computes cp times the first and the spread is (cp-1) blocks, 2(cp-1)/(cp+1) of the mean."""
    mesh, cp = MESHES["cp4"], 4
    measured = {}
    for layout in ("zigzag", "contiguous"):
        per_rank = results("cp4")[Case("ring", True, layout)]
        measured[layout] = [0] * cp
        for r in per_rank:
            measured[layout][_cp_index(mesh, r["rank"])] = r["scores"]["flops"] // B
    zig, flat = measured["zigzag"], measured["contiguous"]
    block = 4 * HQ * D * (S // cp) ** 2
    assert zig == [4 * HQ * D * (2 * cp + 1) * (S // (2 * cp)) ** 2] * cp
    assert max(zig) - min(zig) < np.mean(zig) / cp
    assert flat == [block * (i + 1) for i in range(cp)]
    assert max(flat) - min(flat) == (cp - 1) * block and max(flat) == cp * min(flat)
    assert (max(flat) - min(flat)) / np.mean(flat) == pytest.approx(2 * (cp - 1) / (cp + 1))


def test_ulysses_refuses_kv_heads_cp_does_not_divide():
    """cp=4 with 2 key/value heads: a ValueError on every rank naming the numbers and the fix, before any
    collective (nothing counted)."""
    case = Case("ulysses", True, "contiguous", kv_heads=2)
    ranks = get_pool(4).run(attention_job, MESHES["cp4"], [case], {2: problem(2, seed=2)})
    for got in ranks:
        (r,) = got
        assert "key/value heads (2) must both be multiples of 4" in r["error"]
        assert "ring_attention or allgather_attention" in r["error"] and "k.repeat_interleave(2, dim=1)" in r["error"]
        assert r["bytes"] == {}


# -- no ranks: layouts, closed forms, dry runs and errors -------------------------------------------------
def test_zigzag_order_and_round_trip():
    from meshlib_torch.attention import from_zigzag, to_zigzag, zigzag_indices

    assert zigzag_indices(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    x = torch.randn(2, 3, 16, 4)
    z = to_zigzag(x, 4, 2)
    assert torch.equal(z[:, :, 4:8], torch.cat([x[:, :, 2:4], x[:, :, 12:14]], 2))  # rank 1: chunks 1 and 6
    assert torch.equal(from_zigzag(z, 4, 2), x)
    with pytest.raises(ValueError, match=r"multiple of 8; got 12. Fix: pad the sequence to 16 tokens, or use layout='contiguous'"):
        zigzag_indices(12, 4)


def test_flops_closed_form_totals():
    """Summed over ranks: not causal S²/cp each; causal contiguous S²(cp+1)/2cp; zigzag S²(2cp+1)/4cp (both at
    least the causal half, S²/2), per head and head dim, times 4."""
    from meshlib_torch.attention import attention_flops_per_rank

    for cp in (1, 2, 4, 8):
        f = functools.partial(attention_flops_per_rank, 64, cp, 1, 1)
        assert f(causal=False, layout="contiguous") == f(causal=False, layout="zigzag") == [4 * 64 * 64 // cp] * cp
        assert sum(f(causal=True, layout="contiguous")) * 2 * cp == 4 * 64 * 64 * (cp + 1)
        assert sum(f(causal=True, layout="zigzag")) * 4 * cp == 4 * 64 * 64 * (2 * cp + 1)


def _dry(fn, *, shapes, dtype="float64", mesh=None, extra=(), **kw):
    """The records of a dry run of `fn` on meta tensors of one rank's shards (cp=4 unless `mesh`)."""
    from meshlib.tree import ShapeDtype
    from meshlib_torch.spmd import region_collectives

    mesh = mesh or Mesh(cp=4)
    specs = [P(None, None, "cp")] * 3 + [spec for spec, _ in extra]
    args = [ShapeDtype(s, dtype) for s in shapes] + [a for _, a in extra]
    names = list(kw.pop("names", ()))

    def f(q, k, v, *rest):
        return fn(q, k, v, **dict(zip(names, rest)), **kw)

    return region_collectives(f, mesh=mesh, in_specs=tuple(specs), out_specs=P(None, None, "cp"), args=tuple(args))


def test_a_dry_run_prices_the_ring_in_the_dtype_that_moves():
    """bf16, cp=4, 2 key/value heads, on meta tensors: 3 hops of K and V forward, 2*B*Hkv*L*D*2 bytes each;
    backward K and V twice more and their gradient 3 times, in fp32 (twice the bytes), in the order sent."""
    from meshlib_torch.attention import ring_attention

    length = S // 4
    plan = _dry(ring_attention, shapes=[(B, HQ, length, D), (B, 2, length, D), (B, 2, length, D)], dtype="bfloat16",
                causal=True, layout="zigzag")  # fmt: skip
    hop = 2 * B * 2 * length * D * 2
    assert [(r.phase, r.op, r.kind, r.bytes) for r in plan.records] == [
        ("forward", "ppermute", "send_recv", hop)] * 3 + [("backward", "ppermute", "send_recv", n) for n in (
            hop, 2 * hop, hop, 2 * hop, 2 * hop)]
    assert plan.outputs.shape == (B, HQ, length, D) and plan.outputs.dtype == "bfloat16"


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_ring_keeps_what_its_shard_holds(cp):
    """What `ring_attention` keeps for backward on a rank (its saved tensors, a dry run, bf16, GQA): q, k, v
    and the output, (2*Hq + 2*Hkv)*B*L*D*2 bytes, the rows' log-sum-exp, B*Hq*L*4 (fp32), and the last K/V
    shard to arrive, 2*B*Hkv*L*D*2: all in proportion to L = S/cp, so it falls by cp. (Keeping each shard
    that arrived instead would be 2*B*Hkv*S*D*2, the whole sequence's keys and values.)"""
    from meshlib_torch.attention import ring_attention

    calls = []

    def kept(q, k, v, **kw):
        calls.append([])
        with torch.autograd.graph.saved_tensors_hooks(lambda t: calls[-1].append(t.nbytes) or t, lambda t: t):
            return ring_attention(q, k, v, **kw)

    length, hkv = S // cp, 2
    _dry(kept, shapes=[(B, HQ, length, D), (B, hkv, length, D), (B, hkv, length, D)], dtype="bfloat16",
         mesh=Mesh(cp=cp), causal=True, layout="zigzag")  # fmt: skip
    want = (2 * HQ + 2 * hkv) * B * length * D * 2 + B * HQ * length * 4 + 2 * B * hkv * length * D * 2
    assert sum(calls[-1]) == want


def test_bad_arguments_are_named_with_their_fix():
    """Each raises on meta tensors (before any collective) naming the argument, the numbers and the fix."""
    from meshlib.tree import ShapeDtype
    from meshlib_torch.attention import allgather_attention, ring_attention, ulysses_attention

    q, kv = (B, HQ, 4, D), (B, 2, 4, D)
    with pytest.raises(ValueError, match=r"multiple of 8; got 12. Fix: pad the sequence to 16 tokens"):
        _dry(ring_attention, shapes=[(B, HQ, 3, D), (B, 2, 3, D), (B, 2, 3, D)], layout="zigzag")
    with pytest.raises(ValueError, match=r"4 query heads are not a multiple of 3 key/value heads"):
        _dry(ring_attention, shapes=[q, (B, 3, 4, D), (B, 3, 4, D)])
    with pytest.raises(ValueError, match=r"mask has shape \(4, 4\) per shard; it needs this rank's 4 query rows and all 16 key columns"):
        _dry(allgather_attention, shapes=[q, kv, kv], names=["mask"],
             extra=[(P("cp", None), ShapeDtype((4, 4), "bool"))])  # fmt: skip
    with pytest.raises(ValueError, match=r"doc_ids has shape \(2, 16\) per shard; it needs \(B, S/cp\) = \(2, 4\)"):
        _dry(ring_attention, shapes=[q, kv, kv], names=["doc_ids"], extra=[(P(), ShapeDtype((B, 16), "int64"))])
    with pytest.raises(TypeError, match="doc_ids must be an integer tensor"):
        _dry(ring_attention, shapes=[q, kv, kv], names=["doc_ids"], extra=[(P(None, "cp"), ShapeDtype((B, 16), "float64"))])
    with pytest.raises(ValueError, match=r"layout='diagonal' must be one of \('contiguous', 'zigzag'\)"):
        _dry(ring_attention, shapes=[q, kv, kv], layout="diagonal")
    with pytest.raises(TypeError, match="must be one mesh axis name"):
        _dry(ring_attention, shapes=[q, kv, kv], axis=("cp",))
    with pytest.raises(ValueError, match=r"the query heads \(4\) and the key/value heads \(2\) must both be multiples of 4"):
        _dry(ulysses_attention, shapes=[q, kv, kv])
    with pytest.raises(ValueError, match=r"query heads \(6\).*a 'cp' axis whose size divides 6"):
        _dry(ulysses_attention, shapes=[(B, 6, 4, D), (B, 6, 4, D), (B, 6, 4, D)])


@pytest.mark.parametrize("tile", [7, 1 << 20])
@pytest.mark.parametrize("kind", ["bias", "bool and documents"])
def test_a_block_keeps_no_scores_and_equals_softmax_attention_in_tiles(monkeypatch, tile, kind):
    """`local.attend` (one block: (out, lse), recomputing its scores in backward, a tile of query rows at a time)
    against softmax attention written out and differentiated by autograd: GQA (2 key/value heads, groups of 2),
    a bias and a causal boolean mask, gradients through both out and lse (the merge uses both); fp64, 1e-12.
    With tiles of 7 scores' rows the block runs in uneven tiles."""
    from meshlib_torch.attention import local

    monkeypatch.setattr(local, "TILE", tile)
    monkeypatch.setattr(local, "MIN_ROWS", 1)
    g = torch.Generator().manual_seed(7)
    b, kv, grp, rows, cols, d = 2, 2, 2, 6, 9, 4
    q = torch.randn(b, kv, grp, rows, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv, cols, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv, cols, d, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 1, 1, rows, cols, generator=g, dtype=torch.float64)
    allowed = torch.arange(cols)[None, :] <= torch.arange(rows)[:, None] + 3
    ct, cl = torch.randn(b, kv, grp, rows, d, generator=g, dtype=torch.float64), torch.randn(b, kv, grp, rows, 1, generator=g, dtype=torch.float64)  # noqa: E501
    mask = local.Mask(q_pos=torch.arange(rows) + 3, k_pos=torch.arange(cols), user=bias)  # the same, built per tile
    if kind != "bias":  # a boolean mask of the caller's and documents: each query sees its own document's keys
        docs_q, docs_k = torch.tensor([[0, 0, 1, 1, 1, 2]] * b), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]] * b)
        user = torch.rand(1, 1, 1, rows, cols, generator=g) > 0.2
        mask = local.Mask(torch.arange(rows) + 3, torch.arange(cols), docs_q, docs_k, user)
        allowed = allowed & user & (docs_q[:, None, None, :, None] == docs_k[:, None, None, None, :])
    out, lse = local.attend(q, k, v, 0.5, mask)
    grads = torch.autograd.grad((out * ct).sum() + (lse * cl).sum(), (q, k, v))
    s = torch.einsum("bhgrd,bhcd->bhgrc", q, k) * 0.5 + (bias if kind == "bias" else 0)
    s = s.masked_fill(~allowed, float("-inf"))
    want_lse = torch.logsumexp(s, -1, keepdim=True)
    want = torch.einsum("bhgrc,bhcd->bhgrd", torch.softmax(s, -1), v)
    want_grads = torch.autograd.grad((want * ct).sum() + (want_lse * cl).sum(), (q, k, v))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("parts", [((0, 9, False),), ((0, 9, True),), ((0, 3, False), (3, 6, True))],
                         ids=["visible", "causal", "visible-then-causal"])  # fmt: skip
def test_fused_blocks_equal_the_tiles(parts):
    """`local.attend` with `parts` (torch's fused CPU kernel per part, merged; backward by the kernel's own
    backward given the row's out and lse) against the same block in eager tiles under the `Mask` the parts
    stand for, and against softmax written out: fp64, GQA (2 key/value heads, groups of 3), 6 query rows over
    9 keys (a causal part of 6 keys over 6 rows: aligned). Gradients through out alone take the kernel's
    backward; through out and lse (the merge's) the tiles: both 1e-12."""
    from meshlib_torch.attention import local

    g = torch.Generator().manual_seed(3)
    b, kv, grp, rows, cols, d = 2, 2, 3, 6, 9, 5
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in [(b, kv, grp, rows, d), (b, kv, cols, d), (b, kv, cols, d)])  # fmt: skip
    ct, cl = torch.randn(b, kv, grp, rows, d, generator=g, dtype=torch.float64), torch.randn(b, kv, grp, rows, 1, generator=g, dtype=torch.float64)  # noqa: E501
    allowed = torch.ones(rows, cols, dtype=torch.bool)
    for c0, m, causal in parts:
        if causal:
            allowed[:, c0 : c0 + m] = torch.ones(rows, m, dtype=torch.bool).tril()
    s = (torch.einsum("bhgrd,bhcd->bhgrc", q, k) * 0.4).masked_fill(~allowed, float("-inf"))
    want = torch.einsum("bhgrc,bhcd->bhgrd", torch.softmax(s, -1), v), torch.logsumexp(s, -1, keepdim=True)
    for weight in (0.0, 1.0):  # the gradient of lse: none, or cl
        loss = lambda out, lse, w=weight: (out * ct).sum() + ((lse * cl).sum() * w if w else 0)  # noqa: E731
        fused = local.attend(q, k, v, 0.4, None, parts)
        tiles = local.attend(q, k, v, 0.4, local.parts_mask(parts, rows, q.device))
        for got in (fused, tiles):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            got_grads = torch.autograd.grad(loss(*got), (q, k, v))
            want_grads = torch.autograd.grad(loss(*want), (q, k, v), retain_graph=True)
            for a, e in zip(got_grads, want_grads):
                torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def _flash_calls(fn, kv_heads: int = 2, **kw) -> dict:
    """Calls of CPU's fused attention kernel (forward, backward) in a dry run of `fn` and its backward (cp=4:
    rank 3)."""
    from meshlib_torch.torch_private import TorchDispatchMode

    aten = torch.ops.aten
    names = {aten._scaled_dot_product_flash_attention_for_cpu.default: "forward",
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "backward"}  # fmt: skip
    calls = {"forward": 0, "backward": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in names:
                calls[names[func]] += 1
            return func(*args, **(kwargs or {}))

    length = S // 4
    with Count():
        _dry(fn, shapes=[(B, HQ, length, D), (B, kv_heads, length, D), (B, kv_heads, length, D)], **kw)
    return calls


def test_unmasked_and_aligned_causal_blocks_run_the_fused_kernel():
    """Zigzag, causal, cp=4, on the dry run's rank 3 (chunks 3 and 4 of 8). Chunk 3 sees chunk s of each
    other rank s < 3 whole (3 calls) and itself causally (1); chunk 4 sees chunk s < 3 whole (3) and, on its
    own rank, chunk 3 whole and itself causally (2): 9 kernel calls forward, 9 backward (the ring's and the
    all-gather's, which compute the same blocks). Ulysses puts the gathered head-tail sequence in token
    order and makes one call each way. With documents every block is masked by them: no call, the tiles run."""
    from meshlib.tree import ShapeDtype
    from meshlib_torch.attention import allgather_attention, ring_attention, ulysses_attention

    for fn in (ring_attention, allgather_attention):
        assert _flash_calls(fn, causal=True, layout="zigzag") == {"forward": 9, "backward": 9}
    assert _flash_calls(ulysses_attention, HQ, causal=True, layout="zigzag") == {"forward": 1, "backward": 1}
    docs = (P(None, "cp"), ShapeDtype((B, S // 4), "int64"))  # one rank's shard
    calls = _flash_calls(ring_attention, causal=True, layout="zigzag", names=["doc_ids"], extra=[docs])
    assert calls == {"forward": 0, "backward": 0}
