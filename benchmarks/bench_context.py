"""Context parallelism on 4 gloo ranks: a long sequence against one process, the three cp methods against each
other, how much of the ring's transfer time its asynchronous hops hide, and one block's two kernels.

    python benchmarks/bench_context.py            # all four parts, a few minutes on 2 cores
    python benchmarks/bench_context.py --quick    # short sequences and few rounds: a smoke test

(1) A long sequence: llama-tiny (its rotary table stretched to the sequence) on one sequence of `--seq`
    tokens, fp32, compiled on `Mesh(cp=4)` (ring attention, the default cp_layout) against the model as written
    in one process (`F.scaled_dot_product_attention` on the whole sequence: torch's fused CPU kernel). Both
    from the same initial values, checked to take the same first step. Step time: rounds of `--steps`
    training steps (forward, backward, AdamW), the two alternated (A B, B A, ...), the median of the
    per-round ratios. Peak memory per rank: `PeakTracker` over one forward + backward, the model and
    optimizer state counted as its baseline.
(2) ring against all-gather against all-to-all (`cp_method`): the same model compiled three times on the
    same 4 ranks, `--race-seq` tokens, checked to take the same first step, timed in rotation (ABC, BCA,
    CAB, ...); the median over rounds of each method's step over the ring's.
(3) The overlap of the ring's transfers with its compute, per hop, at the per-shard attention
    (`context_worker.overlap`, full attention so every block is whole): the hops alone (cp-1 blocking
    `lax.ppermute`s of K and V), the blocks alone (the ring's cp blocks against this rank's own K and V),
    the ring with blocking hops (the control), and `ring_attention` itself (asynchronous hops), the forward
    timed, rotated each round, slowest rank. Fraction of the transfer time hidden =
    (t_hops + t_blocks - t_ring) / t_hops, from each round's times, median over rounds.
(4) One block, in this process: torch's fused CPU kernel against eager tiles, forward and backward
    (`kernels`).

The rank-side jobs are in `benchmarks/context_worker.py` (a RankPool pickles them by qualified name).
"""

from __future__ import annotations

import argparse
import statistics
import time

import context_worker
from machine import busy_ticks, describe, ticks_of

from meshlib_torch.testing.pool import get_pool

MODEL, CP = "llama-tiny", 4
METHODS = ("ring", "all-gather", "all-to-all")
MiB = 2**20
TOLERANCE = 1e-4  # first losses, relative (fp32 sums over the whole sequence in another order)


def markdown(title: str, header: tuple, rows: list, notes: tuple = ()) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines + ([""] + list(notes) if notes else []))


def _quartiles(values: list) -> str:
    if len(values) < 2:
        return "-"
    q = statistics.quantiles(values, n=4)
    return f"{q[0]:.2f} - {q[2]:.2f}"


class Others:
    """The share of the machine's busy CPU time that processes other than `pools`' workers took."""

    def __init__(self, *pools):
        self.pids = [pid for pool in pools for pid in pool.pids]
        self.busy, self.mine = busy_ticks(), ticks_of(self.pids)

    def share(self) -> str:
        busy, mine = busy_ticks() - self.busy, ticks_of(self.pids) - self.mine
        return f"{max(0, busy - mine) / max(busy, 1):.0%}"


# -- (1) ---------------------------------------------------------------------------------------------------
def long_sequence(seq: int, rounds: int, steps: int) -> str:
    sides = {"single": get_pool(1), f"cp={CP}": get_pool(CP)}
    for pool in sides.values():
        pool.run(context_worker.forget)  # a worker keeps one built model: start from none
    others = Others(*sides.values())
    times: dict = {s: [] for s in sides}
    firsts = {}
    for r in range(rounds):
        for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            got = sides[side].run(context_worker.long_round, side, MODEL, seq, "ring", steps, timeout=3600)[0]
            times[side].append(got["seconds"])
            firsts[side] = got["first_loss"]
    a, b = firsts.values()
    if abs(a - b) > TOLERANCE * abs(a):
        raise RuntimeError(f"one process and cp={CP} take different first steps: {firsts}")
    peaks = {s: pool.run(context_worker.long_peak, s, MODEL, seq, "ring", timeout=3600) for s, pool in sides.items()}
    share = others.share()
    for pool in sides.values():
        pool.run(context_worker.forget)
    ratios = [c / s for s, c in zip(*times.values(), strict=True)]
    rows = []
    for side, per_rank in peaks.items():
        top = max(per_rank, key=lambda p: p["peak"])
        low = min(per_rank, key=lambda p: p["peak"])
        ours = side != "single"
        rows.append((
            "one process, whole sequence" if not ours else f"compiled, Mesh(cp={CP}), ring",
            f"{seq // (CP if ours else 1):,}", f"{statistics.median(times[side]):.2f}",
            f"**{statistics.median(ratios):.2f}** ({_quartiles(ratios)})" if ours else "1",
            f"{top['peak'] / MiB:,.1f}" + (f" (rank {top['rank']})" if ours else ""),
            f"{low['peak'] / MiB:,.1f} (rank {low['rank']})" if ours else "",
            f"{(top['peak'] - top['state']) / MiB:,.1f}", f"{firsts[side]:.6f}",
        ))  # fmt: skip
    header = ("run", "tokens per rank", "step s (median)", "step / one process (quartiles)", "peak MiB, max rank",
              "peak MiB, min rank", "max peak - state MiB", "first loss")  # fmt: skip
    title = (f"(1) {MODEL}, one sequence of {seq:,} tokens, fp32: Mesh(cp={CP}) on 4 gloo ranks against one process "
             f"({rounds} rounds x {steps} steps, alternated; other processes took {share} of the busy CPU)")
    return markdown(title, header, rows)


# -- (2) ---------------------------------------------------------------------------------------------------
def methods(seq: int, rounds: int, steps: int) -> str:
    pool = get_pool(CP)
    others = Others(pool)
    got = pool.run(context_worker.methods_race, MODEL, seq, METHODS, rounds, steps, timeout=3600)[0]
    share = others.share()
    losses = got["losses"]
    if max(losses.values()) - min(losses.values()) > TOLERANCE * abs(losses["ring"]):
        raise RuntimeError(f"the cp methods take different first steps: {losses}")
    rows = []
    for m in METHODS:
        ratios = [t / r for t, r in zip(got["times"][m], got["times"]["ring"], strict=True)]
        rows.append((
            m, f"{statistics.median(got['times'][m]):.2f}",
            "1" if m == "ring" else f"**{statistics.median(ratios):.2f}** ({_quartiles(ratios)})",
            f"{got['peaks'][m] / MiB:,.1f}", f"{got['peaks'][m] / got['peaks']['ring']:.2f}", f"{losses[m]:.6f}",
        ))  # fmt: skip
    header = ("cp_method", "step s (median)", "step / ring (quartiles)", "peak MiB, max rank", "peak / ring",
              "first loss")  # fmt: skip
    title = (f"(2) {MODEL}, one sequence of {seq:,} tokens, fp32, Mesh(cp={CP}): the three methods ({rounds} rounds x "
             f"{steps} steps, rotated; other processes took {share} of the busy CPU)")  # fmt: skip
    return markdown(title, header, rows)


# -- (3) ---------------------------------------------------------------------------------------------------
def overlap(shapes: list, rounds: int) -> str:
    pool = get_pool(CP)
    others = Others(pool)
    rows = []
    for heads, length, dim in shapes:
        got = pool.run(context_worker.overlap, CP, heads, length, dim, rounds, timeout=3600)[0]
        # forward only: the controls' backward runs autograd through the merges and the blocks' tiles, the
        # ring's its own (`ring._Ring`: a fused kernel per block from the rows' final out and lse), so the
        # two backward times no longer measure the same compute
        for phase, i in (("forward", 0),):
            per = {v: [t[i] for t in got["rounds"][v]] for v in context_worker.VARIANTS}
            hops, blocks = (statistics.median(per[v]) for v in ("only", "none"))
            hidden = {
                v: [(h + b - t) / h for h, b, t in zip(per["only"], per["none"], per[v], strict=True)]
                for v in ("blocking", "async")
            }  # fmt: skip
            rows.append((
                f"{heads} x {length} x {dim}", f"{got['kv_bytes'] / MiB:.2f}", phase,
                f"{hops / (CP - 1) * 1e3:.2f}", f"{blocks / CP * 1e3:.2f}",
                f"{statistics.median(per['blocking']) * 1e3:.1f}", f"{statistics.median(per['async']) * 1e3:.1f}",
                f"{statistics.median(hidden['blocking']):.2f}",
                f"**{statistics.median(hidden['async']):.2f}** ({_quartiles(hidden['async'])})",
            ))  # fmt: skip
    header = ("heads x tokens per rank x head dim", "K+V per hop MiB", "phase", "hop alone ms", "block alone ms",
              "ring, blocking hops ms", "ring, async hops ms", "hidden: blocking (control)",
              "hidden: async (quartiles)")  # fmt: skip
    title = (f"(3) the ring's transfers against its blocks on Mesh(cp={CP}): per hop and per block, fp32, full "
             f"attention ({rounds} rounds, rotated; other processes took {others.share()} of the busy CPU)")
    notes = ("hidden = (t_hops + t_blocks - t_ring) / t_hops per round, the median over rounds; t_hops is the cp-1 "
             "hops alone, t_blocks the cp blocks alone.",)  # fmt: skip
    return markdown(title, header, rows, notes)


# -- (4) ---------------------------------------------------------------------------------------------------
def _block_times(heads: int, length: int, dim: int, causal: bool, rounds: int) -> tuple[dict, float]:
    """{path: (forward s, backward s) per round} of one block on each path, alternated, and the largest
    difference between their outputs and gradients."""
    import torch

    from meshlib_torch.attention import local

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, length, dim, generator=g, requires_grad=True)
    k, v = (torch.randn(1, heads, length, dim, generator=g, requires_grad=True) for _ in range(2))
    ct = torch.randn(1, heads, 1, length, dim, generator=g)
    parts = ((0, length, causal),)
    how = {"fused": (None, parts), "tiles": (local.parts_mask(parts, length, q.device), None)}
    times, outs = {n: ([], []) for n in how}, {}
    for r in range(rounds + 1):  # the first round warms up, not counted
        for name in how if r % 2 else reversed(list(how)):
            t0 = time.perf_counter()
            out, _ = local.attend(q, k, v, dim**-0.5, *how[name])
            t1 = time.perf_counter()
            grads = torch.autograd.grad((out * ct).sum(), (q, k, v))
            t2 = time.perf_counter()
            outs[name] = (out.detach(), *grads)
            if r:
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
    diff = max(float((a - b).abs().max()) for a, b in zip(outs["fused"], outs["tiles"], strict=True))
    return times, diff


def kernels(shapes: list, rounds: int) -> str:
    """One block of a ring rank, forward then backward (the gradient of out: the ring's backward), in this
    process: torch's fused CPU kernel (`local.attend` with `parts`) against the same block in eager tiles
    (`parts_mask`, the path a masked block takes), alternated per round; the median of the per-round ratios."""
    rows = []
    for heads, length, dim, causal in shapes:
        times, diff = _block_times(heads, length, dim, causal, rounds)
        for phase, i in (("forward", 0), ("backward", 1)):
            fused, tiles = times["fused"][i], times["tiles"][i]
            ratio = [t / f for t, f in zip(tiles, fused, strict=True)]
            rows.append((
                f"{heads} x {length} x {dim}", "causal (diagonal)" if causal else "all visible", phase,
                f"{statistics.median(fused) * 1e3:.1f}", f"{statistics.median(tiles) * 1e3:.1f}",
                f"**{statistics.median(ratio):.1f}** ({_quartiles(ratio)})", f"{diff:.1e}",
            ))  # fmt: skip
    header = ("heads x tokens x head dim", "block", "phase", "fused kernel ms", "eager tiles ms",
              "tiles / fused (quartiles)", "max difference (out, grads)")  # fmt: skip
    title = (f"(4) one block, fp32, in one process: torch's fused CPU kernel against eager tiles ({rounds} "
             "rounds, alternated)")
    return markdown(title, header, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192, help="(1): tokens in the one sequence")
    ap.add_argument("--rounds", type=int, default=3, help="(1): rounds, each timing both sides, alternated")
    ap.add_argument("--steps", type=int, default=1, help="(1), (2): steps of each side per round")
    ap.add_argument("--race-seq", type=int, default=4096, help="(2): tokens in the one sequence")
    ap.add_argument("--race-rounds", type=int, default=6, help="(2): rounds, each timing the three methods")
    ap.add_argument("--overlap-rounds", type=int, default=5, help="(3): rounds, each timing the four variants")
    ap.add_argument("--kernel-rounds", type=int, default=7, help="(4): rounds, each timing both block paths")
    ap.add_argument("--quick", action="store_true", help="short sequences and 2 rounds of each")
    args = ap.parse_args()
    shapes = [(8, 64, 128), (8, 256, 128), (4, args.seq // CP, 8)]
    blocks = [(8, 2048, 64, True), (8, 2048, 64, False), (4, args.seq // CP, 8, True)]
    if args.quick:
        args.seq, args.race_seq, args.rounds, args.race_rounds, args.overlap_rounds = 2048, 1024, 2, 2, 2
        args.kernel_rounds, shapes, blocks = 2, [(8, 64, 128), (4, 256, 8)], [(8, 256, 64, True)]
    start = time.perf_counter()
    print(describe() + "\n")
    tables = []
    for part in (lambda: long_sequence(args.seq, args.rounds, args.steps),
                 lambda: methods(args.race_seq, args.race_rounds, args.steps),
                 lambda: overlap(shapes, args.overlap_rounds),
                 lambda: kernels(blocks, args.kernel_rounds)):  # fmt: skip
        tables.append(part())
        print(tables[-1] + "\n", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
