"""Gradient buckets: which parameters' gradients ZeRO-0 sums in one all-reduce, as DDP groups them, and
when each is started and waited for.

One function serves the plan (`estimates.records.dp_collectives` prices one
all-reduce per bucket) and the runtime (`runtime.parallelisms.data.GradSync`
issues one per bucket), so the two agree by construction. One class, `Buckets`,
starts and waits for them, in the runtime (a real all-reduce) and in the dry
run (`estimates.dryrun`, which only allocates the buffers), so the memory the
plan charges is what the runtime holds.

DDP's rules (torch/nn/parallel/distributed.py, `_BucketCapacityConfig` and
`dist._compute_bucket_assignment_by_size`): parameters in registration order,
one running bucket per kind (here: the axes a gradient is summed over), a
bucket closed once it holds its limit: 1 MiB for the first
(`dist._DEFAULT_FIRST_BUCKET_BYTES`), 25 MiB after (`bucket_cap_mb`). The
buckets are then reversed, to approximate the order backward produces them,
so the small first bucket holds the gradients backward finishes last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable

import torch

from ..torch_private import at_backward_end, backward_id, local_tensor

FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 << 20  # DistributedDataParallel's default bucket_cap_mb


def grad_buckets(
    entries: Iterable[tuple[str, Hashable, int]], first: int | None = None, cap: int | None = None
) -> list[tuple[Hashable, list[str], int]]:
    """`(kind, names, bytes)` per bucket, in the order backward fills them, from `(name, kind, bytes)` per
    parameter in registration order. Only parameters of one kind share a bucket; each kind's first
    bucket closes at `first` bytes (`FIRST_BUCKET_BYTES`), the rest at `cap` (`BUCKET_BYTES`)."""
    first = FIRST_BUCKET_BYTES if first is None else first
    cap = BUCKET_BYTES if cap is None else cap
    open_: dict[Hashable, tuple[int, list[str], int]] = {}  # kind: (first index, names, bytes)
    closed: list[tuple[int, Hashable, list[str], int]] = []
    started: set = set()
    for i, (name, kind, nbytes) in enumerate(entries):
        start, names, held = open_.get(kind, (i, [], 0))
        names.append(name)
        held += nbytes
        if held >= (cap if kind in started else first):
            closed.append((start, kind, names, held))
            started.add(kind)
            open_.pop(kind, None)
        else:
            open_[kind] = (start, names, held)
    closed += [(start, kind, names, held) for kind, (start, names, held) in open_.items()]
    closed.sort(key=lambda b: b[0])
    return [(kind, names, held) for _, kind, names, held in reversed(closed)]


def most_held(sizes: list[int], inflight: int | None = None) -> int:
    """The most bytes of buckets (`sizes`, in the order they start) held at once when at most `inflight`
    (`Buckets.INFLIGHT`) are: the largest sum of that many consecutive ones."""
    k = Buckets.INFLIGHT if inflight is None else inflight
    return max((sum(sizes[i : i + k]) for i in range(max(1, len(sizes) - k + 1))), default=0)


class _Bucket:
    """Gradients summed in one all-reduce: their parameters, the group and its axes' name."""

    def __init__(self, index: int, params: list[torch.Tensor], group, axis: str):
        self.index, self.params, self.group, self.axis = index, params, group, axis


class Buckets:
    """Sum every parameter's gradient over its group (`groups`: per name, the group and its axes' name;
    None: nothing to sum) in DDP's buckets (`grad_buckets`, in registration order `order` reversed),
    in `reduce_dtype`.

    A bucket is started (`reduce`, asynchronous) once its gradients are in and every bucket before it
    has been started, so the sums run behind the rest of backward; at backward's end the rest are
    started and all are waited for, so the gradients are summed when `backward()` returns (a parameter
    backward does not reach holds its bucket, and every later one, until then, as under DDP). At most
    `INFLIGHT` buckets' buffers are held at once (DDP keeps one for every bucket, a second copy of
    the gradients). `enabled` off: gradients accumulate unsummed until `finish()`. A gradient added to
    one already summed is refused (`_arriving`): summed again, that part would count once per rank."""

    INFLIGHT = 2

    def __init__(self, params: dict[str, torch.nn.Parameter], groups: dict[str, tuple | None],
                 reduce_dtype: torch.dtype, order=()):  # fmt: skip
        self.reduce_dtype = reduce_dtype
        self.enabled = True
        first = {n: i for i, n in enumerate(order)}
        named = [(n, p) for n, p in params.items() if p.requires_grad and groups[n] is not None]
        named.sort(key=lambda item: first.get(item[0], len(first)))  # stable: names not in `order` last
        entries = [(n, groups[n][1], local_tensor(p).numel() * reduce_dtype.itemsize) for n, p in named]
        by_name = dict(named)
        buckets = grad_buckets(entries)
        self.buckets = [_Bucket(i, [by_name[n] for n in ns], *groups[ns[0]]) for i, (_, ns, _) in enumerate(buckets)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.names = {id(p): n for n, p in named}
        self.params = [p for b in self.buckets for p in b.params]
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self.handles += [p.register_hook(lambda g, p=p: self._arriving(p)) for p in self.params]
        self._summed: set[int] = set()  # parameters whose gradient holds a sum, until it is cleared
        self.order = InOrder([len(b.params) for b in self.buckets], lambda i: self._start(self.buckets[i]), self._land)

    def reduce(self, buf: torch.Tensor, bucket: _Bucket):
        """Start summing `buf` over `bucket.group`; returns what `.wait()`s for it."""
        raise NotImplementedError

    def _arriving(self, p: torch.Tensor) -> None:
        """Before a new gradient is added into `p.grad`: refuse to add it to a sum (the next sum would count
        the summed part once per rank), whether or not this backward sums."""
        if id(p) not in self._summed:
            return
        if p.grad is not None and bool(local_tensor(p.grad).any()):
            raise RuntimeError(
                f"a gradient of {self.names[id(p)]!r} is being added to one already summed over "
                f"{self.bucket_of[id(p)].axis!r} by an earlier backward (gradient sync was on for it), so "
                "the sum would count that part once per rank. Fix: clear the gradients after each update "
                "(opt.zero_grad()), and when accumulating microbatches turn the sync off for all but the "
                "last (set_gradient_sync(False)), or use train_step, which does both"
            )
        self._summed.discard(id(p))  # cleared since (None, or zeroed in place)

    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        bucket = self.bucket_of[id(p)]
        if not self.order.arrived(bucket.index):
            raise RuntimeError(
                f"the gradient of {self.names[id(p)]!r} arrived after its bucket was summed over "
                f"{bucket.axis!r} (a second backward through it in one step, or a backward that ended early). "
                "Fix: run one backward per microbatch, with gradient sync off (set_gradient_sync(False)) "
                "for all but the last"
            )

    def finish(self) -> None:
        """Start every bucket not yet started (a parameter without a gradient counts zeros), wait for all,
        and make ready for the next backward."""
        self.order.finish()

    def _start(self, bucket: _Bucket) -> tuple:
        grads = [None if p.grad is None else local_tensor(p.grad) for p in bucket.params]
        for p, g in zip(bucket.params, grads):
            if id(p) in self._summed and g is not None and bool(g.any()):  # no backward has cleared it since
                raise RuntimeError(
                    f"the gradient of {self.names[id(p)]!r} already holds its sum over {bucket.axis!r} (a "
                    "`finish()`/`flush()` after a backward that summed, with no new gradient since): summed "
                    "again it would count once per rank. Fix: sum once per step: flush only after backwards "
                    "run with gradient sync off, and clear the gradients after each update (opt.zero_grad())"
                )
        sizes = [local_tensor(p).numel() for p in bucket.params]
        buf = torch.empty(sum(sizes), dtype=self.reduce_dtype, device=local_tensor(bucket.params[0]).device)
        pieces = buf.split(sizes)
        for g, piece in zip(grads, pieces):
            piece.copy_(g.reshape(-1)) if g is not None else piece.zero_()
        return self.reduce(buf, bucket), bucket.params, grads, pieces

    def _land(self, work, params, grads, pieces) -> None:
        work.wait()
        for p, g, piece in zip(params, grads, pieces):
            if g is not None:
                g.copy_(piece.view(g.shape))
                self._summed.add(id(p))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class InFlight:
    """Collectives started and not yet waited for, oldest first, at most `Buckets.INFLIGHT`: `make_room`
    lands the oldest until one more may start, `drain` lands them all, `drop` waits for them all and lands
    none; `land(work, *entry)` waits for one (`work`) and puts its result where it goes."""

    def __init__(self, land):
        self.land, self.running = land, deque()

    def make_room(self) -> None:
        while len(self.running) >= Buckets.INFLIGHT:
            self.land(*self.running.popleft())

    def add(self, work, *entry) -> None:
        self.running.append((work, *entry))

    def drain(self) -> None:
        while self.running:
            self.land(*self.running.popleft())

    def drop(self) -> None:
        while self.running:
            self.running.popleft()[0].wait()


class InOrder:
    """Start buckets in order as backward fills them, with at most `Buckets.INFLIGHT` in flight (`running`):
    bucket i starts (`start(i)`, which returns its `(work, *entry)` for `land`) once `needed[i]` of its
    gradients are in (`arrived`) and every bucket before it has started. At backward's end (`finish`, queued
    by the first gradient) the rest start and all land. `begin()` runs as a backward's first gradient
    arrives, `end()` once all landed.

    A backward that raised midway never reaches its end: its sums are left in flight and its counts stale.
    The next backward's first gradient (or a `finish` outside backward) waits for those sums, drops them
    (the gradients they were cut from belong to a step that failed) and counts afresh, as if the failed
    backward had not run its hooks; every rank that raised at the same point issues the same collectives."""

    def __init__(self, needed: list[int], start, land, begin=lambda: None, end=lambda: None):
        self.needed, self.start, self.begin, self.end = list(needed), start, begin, end
        self.running = InFlight(land)
        self.ready, self.next, self.task = [0] * len(self.needed), 0, None  # task: the backward counting

    def arrived(self, i: int) -> bool:
        """One more gradient of bucket i is in; False (not counted) where bucket i had already started."""
        self._forget_failed()
        if self.task is None:
            self.task = backward_id()
            self.begin()
            at_backward_end(self.finish)
        if i < self.next:
            return False
        self.ready[i] += 1
        while self.next < len(self.needed) and self.ready[self.next] >= self.needed[self.next]:
            self._start_next()
        return True

    def finish(self) -> None:
        """Start every bucket not yet started, land all, and make ready for the next backward."""
        self._forget_failed()
        while self.next < len(self.needed):
            self._start_next()
        self.running.drain()
        self._reset()
        self.end()

    def _start_next(self) -> None:
        self.running.make_room()
        self.running.add(*self.start(self.next))
        self.next += 1

    def _forget_failed(self) -> None:
        if self.task is not None and backward_id() != self.task:  # that backward raised before its end
            self.running.drop()
            self._reset()

    def _reset(self) -> None:
        self.ready, self.next, self.task = [0] * len(self.needed), 0, None


__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Buckets", "InFlight", "InOrder", "grad_buckets", "most_held"]
