"""Micro-benchmarks of one rank's compute, run inside a gloo rank process as meshlib's ranks compute.

Every function here runs on a rank of `meshlib_torch.testing.pool` (one torch thread, as every rank has:
`torch.set_num_threads(1)`, the pool's and torchrun's `OMP_NUM_THREADS=1`) and returns plain data. The
timing rule, `timed`, is shared by all of them: a warm-up call, then batches of back-to-back calls that
last about `target` seconds each; the time per call of the fastest batch and of the median one. The
profile is fitted to the fastest: on a shared machine other processes only ever add time, so the fastest
batch is the one they disturbed least (on a quiet machine the two are within a few percent; the raw
measurements keep both, and the spread between them says how quiet it was).

- `matmul_times`: a matrix product's time by size, dtype and operand layout (torch.mm on square shapes and
  on the three products of a transformer's linear layer: forward, input gradient, weight gradient);
- `memory_times`: elementwise ops (copy, add, mul) from cache-sized to memory-sized tensors;
- `attention_times`: torch's fused attention kernel (scaled_dot_product_attention, causal), forward and
  backward, by query length and head dim;
- `host_times`: tiny ops, where the time is Python, the dispatcher and autograd, not arithmetic;
- `busy_compute`: one fixed job, every rank of the pool at once, to see ranks share the cores;
- `lockstep`: every rank alternates a segment of products with a small all-reduce, as a synchronous
  training step alternates compute and collectives, to see what the synchronization costs beyond both.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from meshlib import Compute

from ..torch_private import flash_attention, flash_attention_grads

__all__ = [
    "attention_times", "busy_compute", "host_times", "lockstep", "matmul_shapes", "matmul_times", "memory_times",
    "timed",
]  # fmt: skip

DTYPES = ("float32", "float64", "bfloat16")
# operand layouts, as a linear layer y = x @ W.T (x: tokens x in, W: out x in) runs its three products
LAYOUTS = ("nn", "nt", "tn")  # nn: dX = dY @ W; nt: y = x @ W.T (F.linear); tn: dW = dY.T @ x


def timed(fn, *, target: float = 0.02, batches: int = 5, max_call: float = float("inf")):
    """(fastest, median) seconds per call of `fn()` over `batches` batches: one warm-up call, an estimate
    (calls for at least 1 ms), then each batch back-to-back calls for about `target` seconds (at least
    one call), its mean. None, after the warm-up only, when that call took more than `max_call` seconds."""
    start = time.perf_counter()
    fn()
    if time.perf_counter() - start > max_call:
        return None
    calls, start = 0, time.perf_counter()
    while calls == 0 or time.perf_counter() - start < 1e-3:
        fn()
        calls += 1
    estimate = (time.perf_counter() - start) / calls
    reps = max(1, min(100_000, round(target / max(estimate, 1e-7))))
    means = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        means.append((time.perf_counter() - start) / reps)
    return min(means), statistics.median(means)


def _pin() -> None:
    torch.set_num_threads(1)  # the pool's ranks run one thread each, as under torchrun with OMP_NUM_THREADS=1
    torch.set_grad_enabled(False)


def matmul_shapes(quick: bool) -> list[tuple[str, str, int, int, int]]:
    """(shape family, layout, m, k, n) of each product measured, from ~1e5 to ~1e10 FLOPs (2·m·k·n).

    `square`: torch.mm of n x n by n x n. `linear`: a transformer MLP's up projection (tokens t, hidden h
    to 4h) as its step runs it: forward x @ W.T (nt), input gradient dY @ W (nn), weight gradient dY.T @ x
    (tn), each 8·t·h² FLOPs."""
    squares = (64, 256, 1024) if quick else (40, 64, 100, 160, 256, 400, 640, 1024, 1600)
    linears = ((128, 32), (512, 256), (2048, 512)) if quick else (
        (64, 16), (128, 32), (256, 64), (512, 128), (512, 256), (1024, 384), (2048, 512), (2048, 768))  # fmt: skip
    out = [("square", "nn", n, n, n) for n in squares]
    for t, h in linears:
        out += [("linear", "nt", t, h, 4 * h), ("linear", "nn", t, 4 * h, h), ("linear", "tn", 4 * h, t, h)]
    return out


def _operands(layout: str, m: int, k: int, n: int, dtype: torch.dtype):
    """Contiguous tensors as the layer holds them; the product is `a @ b` of an (m, k) by a (k, n) view."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(k, m, generator=g).to(dtype).t() if layout == "tn" else torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, k, generator=g).to(dtype).t() if layout == "nt" else torch.randn(k, n, generator=g).to(dtype)
    return a, b


def matmul_times(shapes, dtypes=DTYPES, *, target: float = 0.02, batches: int = 5, max_call: float = 0.3) -> list:
    """Seconds per matrix product, as `(dtype, family, layout, m, k, n, fastest, median)` rows.

    Each product is `torch.mm(a, b)` on operands laid out as the layer holds them (`matmul_shapes`), timed by
    `timed`. Within a dtype, family and layout, shapes go smallest first; once one call takes more than
    `max_call` seconds the larger ones are skipped (CPU bf16 products run ~10-60x slower than fp32)."""
    _pin()
    rows, slow = [], set()
    for name in dtypes:
        dtype = getattr(torch, name)
        for family, layout, m, k, n in sorted(shapes, key=lambda s: s[2] * s[3] * s[4]):
            if (name, family, layout) in slow:
                continue
            a, b = _operands(layout, m, k, n, dtype)
            t = timed(lambda a=a, b=b: torch.mm(a, b), target=target, batches=batches, max_call=max_call)
            if t is None:
                slow.add((name, family, layout))
                continue
            rows.append((name, family, layout, m, k, n, *t))
    return rows


MEMORY_OPS = ("copy", "add_out", "add", "mul", "scale")
MEMORY_SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 25)  # fp32 elements: 1, 4, 16 and 128 MiB tensors


def memory_times(sizes=MEMORY_SIZES, *, batches: int = 5) -> list[tuple[str, int, float, float, int]]:
    """Elementwise ops on fp32 tensors of each size, as `(op, numel, fastest, median seconds per call,
    bytes it reads and writes)` rows. `copy`: out.copy_(a); `add_out`: torch.add(a, b, out=out) (tensors
    kept: streaming); `add`, `mul`: a + b, a * b as a model computes them (a new tensor each call);
    `scale`: a * 2.0 (new tensor). This machine's caches: 1 MiB L2 per core, 32 MiB L3; tensors of 16 MiB
    (three of them: 48 MiB) stream from memory, and above 32 MiB glibc maps every new tensor afresh (page
    faults on first touch). Each by `timed`: batches of about 10 ms, the fastest and the median."""
    _pin()
    rows = []
    for numel in sizes:
        ops = _elementwise(numel)
        rows += [(op, numel, *timed(fn, target=0.01, batches=batches), nbytes) for op, (fn, nbytes) in ops.items()]
    return rows


def _elementwise(numel: int) -> dict:
    """`{op: (a no-argument function, bytes it reads and writes)}` on fp32 tensors of `numel` elements."""
    a, b, out = torch.rand(numel), torch.rand(numel), torch.empty(numel)
    size = numel * 4
    return {
        "copy": (lambda: out.copy_(a), 2 * size),
        "add_out": (lambda: torch.add(a, b, out=out), 3 * size),
        "add": (lambda: a + b, 3 * size),
        "mul": (lambda: a * b, 3 * size),
        "scale": (lambda: a * 2.0, 2 * size),
    }


# the grid fused attention is measured on: query lengths around the block sizes torch's CPU kernel switches
# at (32 query rows below 192, 64 below 768, 256 from there: aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)
# and the head dims of small and large models
ATTENTION_SEQS = (64, 128, 256, 512, 1024, 2048)
ATTENTION_DIMS = (16, 32, 64, 128)
ATTENTION_FLOPS = 2e7  # FLOPs a forward call is given where it can (batch·heads up to 64): about 0.5 ms here


def attention_times(seqs=ATTENTION_SEQS, dims=ATTENTION_DIMS, *, target: float = 0.02,
                    batches: int = 5) -> list[tuple[str, int, int, int, float, float, float]]:  # fmt: skip
    """`(pass, sequence, head dim, batch·heads, FLOPs, fastest, median seconds)` of one call of torch's causal
    fp32 flash attention kernel, forward (`F.scaled_dot_product_attention`, which runs it) and backward (the
    kernel's own backward op, which autograd runs on its saved output and log-sum-exp), on (1, batch·heads,
    sequence, head dim) q, k and v, by `timed`, over the grid `seqs` x `dims`. FLOPs as the plan counts a
    fused call (`meshlib.Compute.attention_call`)."""
    _pin()
    rows = []
    for seq in seqs:
        for dim in dims:
            bh = max(1, min(64, round(ATTENTION_FLOPS / (2.0 * seq * seq * dim))))
            forward, backward = _attention_calls(bh, seq, dim)
            for name, call, back in (("forward", forward, False), ("backward", backward, True)):
                flops = Compute.attention_call(bh, seq, seq, dim, dim, backward=back)[0]
                rows.append((name, seq, dim, bh, flops, *timed(call, target=target, batches=batches)))
    return rows


def _attention_calls(bh: int, seq: int, dim: int):
    """(forward, backward): one call each of the causal flash attention kernel on (1, bh, seq, dim) q, k, v."""
    q, k, v = (torch.randn(1, bh, seq, dim) for _ in range(3))
    scale = dim**-0.5
    out, lse = flash_attention(q, k, v, True, scale)
    grad = torch.randn_like(out)
    return (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda: flash_attention_grads(grad, q, k, v, out, lse, True, scale))  # fmt: skip


def host_times(*, chain: int = 200, target: float = 0.02, batches: int = 5) -> dict[str, tuple[float, float]]:
    """`{what: (fastest, median) seconds}` of host time per op, on tensors of 8 elements (the arithmetic
    takes nanoseconds):

    - `op`: `x + y` without autograd (Python, the dispatcher, the allocator);
    - `op_grad`: `x * y` with `x` requiring grad, as a training forward runs (autograd records a node);
    - `matmul`: torch.mm of 2 x 4 by 4 x 2 (a product's own dispatch, without autograd);
    - `backward_op`: per op of a chain of `chain` multiplications, what backward() costs: (time of
      forward + backward - time of the forward alone) / `chain`.
    Each by `timed`."""
    _pin()
    x, y = torch.rand(8), torch.rand(8)
    xg = torch.rand(8, requires_grad=True)
    a, b = torch.rand(2, 4), torch.rand(4, 2)
    out = {"op": timed(lambda: x + y, target=target, batches=batches),
           "matmul": timed(lambda: torch.mm(a, b), target=target, batches=batches)}  # fmt: skip
    with torch.enable_grad():
        out["op_grad"] = timed(lambda: xg * y, target=target, batches=batches)
        forward = timed(lambda: _chain(xg, y, chain), target=target, batches=batches)
        both = timed(lambda: _chain(xg, y, chain).sum().backward(), target=target, batches=batches)
    out["backward_op"] = tuple(max(0.0, t - f) / chain for t, f in zip(both, forward))
    return out


def _chain(x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x * y
    return x


def busy_compute(alone: bool, *, m: int = 512, k: int = 512, n: int = 2048, reps: int = 10, rounds: int = 3,
                 numel: int = 1 << 24) -> list[dict] | None:  # fmt: skip
    """Every rank of the pool computes at once (or rank 0 `alone`, while the others return at once and wait,
    idle, for their next job). In each of `rounds` rounds, each after a barrier of its own, each runs `reps`
    products x @ W.T of (m, k) by (n, k) in fp32 (the `linear` forward: 2·m·k·n FLOPs each), then `reps`
    fresh `a + b` of `numel` fp32 elements (64 MiB each at the default), then 5,000·`reps` tiny `x * y` under
    autograd (host time per op; about 0.1 s alone, so that the ranks' runs overlap: a job shorter than the
    ranks' spread after the job before ran one rank after another and read as fast as alone). Returns, per
    round, this rank's seconds for each and the FLOPs, bytes and ops they are; the caller takes the slowest
    rank of a round (the one a synchronous step waits for) and the fastest round. One warm-up call of each
    first."""
    if alone and dist.get_rank() > 0:
        return None
    _pin()
    x, w = torch.randn(m, k), torch.randn(n, k)
    a, b = torch.rand(numel), torch.rand(numel)
    xg, y = torch.rand(8, requires_grad=True), torch.rand(8)
    jobs = {
        "matmul": (lambda: torch.mm(x, w.t()), reps, 2.0 * m * k * n),
        "memory": (lambda: a + b, reps, 3.0 * numel * 4),
        "host": (lambda: xg * y, 5000 * reps, 1.0),
    }
    out = []
    with torch.enable_grad():
        for fn, _, _ in jobs.values():
            fn()
        for _ in range(rounds):
            out.append({})
            for what, (fn, calls, work) in jobs.items():
                if not alone:
                    dist.barrier()  # every kind of work starts together
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                out[-1] |= {what: time.perf_counter() - start, f"{what}_work": work * calls}
    return out


def lockstep(*, products: int = 10, size: int = 256, rounds: int = 20, repeats: int = 3) -> list[dict]:
    """Every rank of the pool, `repeats` times, each after a barrier: `rounds` segments of `products` fp32
    products of `size` x `size` matrices with no collective between them (`busy`); `rounds` all-reduces of
    1 KiB alone (`collective`); and `rounds` of the two alternating (`both`: a segment, then an all-reduce,
    as a step computes up to a collective and waits in it). Returns this rank's seconds per round of each,
    per repeat; the caller takes the slowest rank (`both` waits for it at every all-reduce)."""
    _pin()
    a, b, buf = torch.randn(size, size), torch.randn(size, size), torch.ones(256)

    def segment():
        for _ in range(products):
            torch.mm(a, b)

    jobs = {"busy": segment, "collective": lambda: dist.all_reduce(buf),
            "both": lambda: (segment(), dist.all_reduce(buf))}  # fmt: skip
    segment(), dist.all_reduce(buf)
    out = []
    for _ in range(repeats):
        out.append({})
        for what, fn in jobs.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(rounds):
                fn()
            out[-1][what] = (time.perf_counter() - start) / rounds
    return out
