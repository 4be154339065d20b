"""ZeRO-0's gradient sum in DDP's buckets: the same buckets as torch's own assignment, the plan's records
equal to what the ranks issue, the sums started behind backward, and the single process's training.

References: `torch.distributed._compute_bucket_assignment_by_size` (what DDP's reducer is built from),
and the unsharded run (the parity harness).
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlib import Mesh
from meshlib_torch.compiler.buckets import grad_buckets
from meshlib_torch.testing.parity import RunConfig, compare, train_reference
from meshlib_torch.testing.pool import get_pool


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 700), st.sampled_from([torch.float32, torch.float64])), min_size=1, max_size=40),
    st.integers(64, 2048), st.integers(64, 8192),
)  # fmt: skip
def test_the_buckets_are_ddps(params, first, cap):
    """Parameters of two kinds (torch keys them by dtype): the buckets torch assigns, reversed as DDP's
    reducer takes them, are `grad_buckets`'s."""
    tensors = [torch.empty(n, dtype=dtype) for n, dtype in params]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])
    entries = [(str(i), t.dtype, t.numel() * t.element_size()) for i, t in enumerate(tensors)]
    ours = grad_buckets(entries, first, cap)
    assert [[int(n) for n in names] for _, names, _ in ours] == list(reversed(theirs))
    assert all(len({tensors[int(n)].dtype for n in names} | {kind}) == 1 for kind, names, _ in ours)
    assert [sum(entries[int(n)][2] for n in names) for _, names, _ in ours] == [nbytes for _, _, nbytes in ours]


def _patched(first: int, cap: int):
    """Small buckets on every rank (the defaults, 1 and 25 MiB, hold a tiny model's gradients in one or two)."""
    from meshlib_torch.compiler import buckets

    saved = buckets.FIRST_BUCKET_BYTES, buckets.BUCKET_BYTES
    buckets.FIRST_BUCKET_BYTES, buckets.BUCKET_BYTES = first, cap
    return saved


def _restore(saved) -> None:
    from meshlib_torch.compiler import buckets

    buckets.FIRST_BUCKET_BYTES, buckets.BUCKET_BYTES = saved


def _one_backward(run: RunConfig, first: int, cap: int):
    """One backward on the ranks: each bucket's all-reduce as issued, the plan's, and how many had started
    when the gradient of the parameter registered second came in (the first is alone in the last bucket:
    the embedding, or a norm under 1 KiB)."""
    from meshlib_torch.runtime.comm import CommCounter
    from meshlib_torch.testing.parity import batch_of, build_parallel

    saved = _patched(first, cap)
    try:
        par = build_parallel(run)
        issued = []

        class Log(CommCounter):
            def record(self, phase, kind, axis, nbytes, where):
                issued.append((phase, kind, axis, nbytes))

        par.grad_sync.counter = Log()
        started = []
        second = list(par.compiled.traced.params)[1]
        par.named_model_parameters()[second].register_post_accumulate_grad_hook(lambda p: started.append(len(issued)))
        par(*batch_of(run, 0)).backward()
        planned = [(c.phase, c.kind, "_".join(c.axes), c.bytes) for c in par.plan.collectives if c.op == "grad sync"]
        return issued, planned, started, [len(b.params) for b in par.grad_sync.buckets]
    finally:
        _restore(saved)


def _train(run: RunConfig, first: int, cap: int):
    from meshlib_torch.testing.parity import train_parallel

    saved = _patched(first, cap)
    try:
        return train_parallel(run)
    finally:
        _restore(saved)


CASES = [
    RunConfig(model="llama-tiny", mesh="dp=2"),
    RunConfig(model="llama-tiny", mesh="dp=2,tp=2", dtype="float32", precision="bf16", lr=1e-3),
    RunConfig(model="moe-tiny", mesh="dp=2,ep=2", seq_len=8),
]


@pytest.mark.ranks
@pytest.mark.parametrize("run", CASES, ids=lambda r: f"{r.model}-{r.mesh}-{r.precision or r.dtype}")
def test_the_ranks_sum_the_plans_buckets_behind_backward(run):
    """Buckets of 4 KiB, the first 1 KiB: the ranks issue one all-reduce per planned bucket, in the plan's
    order and bytes; most are started before backward reaches the second parameter; and three AdamW steps
    equal the single process's. With experts, their weights (summed over dp alone) bucket apart."""
    pool = get_pool(Mesh.parse(run.mesh).size)
    for issued, planned, started, sizes in pool.run(_one_backward, run, 1024, 4096):
        assert issued == planned and len(planned) == len(sizes) >= 4
        assert started and 0 < started[0] < len(planned)  # the sums overlap backward; the last waits for it
    if "ep" in run.mesh:
        assert {axis for _, _, axis, _ in planned} == {"dp", "dp_ep"}
    compare(train_reference(run), pool.run(_train, run, 1024, 4096)[0], run.tolerance)


class _Done:
    """A sum that is already done."""

    def wait(self) -> None:
        pass


def _doubling(params: dict):
    from meshlib_torch.compiler.buckets import Buckets

    started = []

    class Doubling(Buckets):
        def reduce(self, buf, bucket):
            started.append(len(bucket.params))
            buf.mul_(2)  # as two ranks holding the same gradient would sum it
            return _Done()

    groups = {n: (None, "dp") for n in params}
    return Doubling(params, groups, torch.float64, order=list(params)), started


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).double()
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    return model, dict(model.named_parameters()) | {"unused": unused}


def _bucketed(unused: bool = True):
    """`_model()`'s model and parameters (without the unused one: `unused=False`), an input, the gradients one
    process computes for it, and `_doubling` buckets of 64 bytes (8 doubles) over those parameters."""
    model, params = _model()
    params = params if unused else dict(model.named_parameters())
    x = torch.randn(5, 4, dtype=torch.float64)
    reference = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    with _caps(64, 64):
        sync, started = _doubling(params)
    return model, params, x, reference, sync, started


def _assert_doubled(model, reference) -> None:
    """Every gradient exactly twice the one-process reference: two ranks' sum."""
    for (name, p), want in zip(model.named_parameters(), reference):
        torch.testing.assert_close(p.grad, 2 * want, rtol=0, atol=0, msg=name)


def test_a_backward_returns_with_every_gradient_summed_and_unused_ones_left_alone():
    """Buckets of 64 bytes (8 doubles), in one process: each gradient comes back doubled (two ranks' sum),
    the buckets start in reverse registration order, and a parameter backward never reached keeps no
    gradient while its bucket is still summed (zeros, so every rank issues the same collectives)."""
    model, params, x, reference, sync, started = _bucketed()
    model(x).sum().backward()
    _assert_doubled(model, reference)
    assert params["unused"].grad is None
    assert started == [len(b.params) for b in sync.buckets] and len(started) == len(sync.buckets) >= 4
    assert any(p is params["unused"] for p in sync.buckets[0].params)  # registered last: in the first bucket


def test_adding_to_a_summed_gradient_is_refused():
    """A second backward with the sync on, without clearing the gradients between, would add to a sum and
    sum it again (n times the first part): refused, naming the parameter and the fix. Cleared (None, or
    zeroed in place), the next backward sums again."""
    model, _, x, _, sync, _ = _bucketed()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"already summed over 'dp'.*zero_grad"):
        model(x).sum().backward()
    model.zero_grad(set_to_none=False)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    sync.enabled = False  # accumulating: nothing summed, nothing refused
    model(x).sum().backward()
    model(x).sum().backward()
    sync.finish()


def test_summing_a_summed_gradient_again_is_refused():
    """`finish()` (a pipeline's flush) right after a backward that summed would start every bucket again and
    sum the sums: refused before any collective starts, naming the parameter. After the gradients are cleared
    and refilled with the sync off, it sums them once: exactly twice the reference."""
    model, _, x, reference, sync, started = _bucketed()
    model(x).sum().backward()
    started.clear()
    with pytest.raises(RuntimeError, match=r"already holds its sum over 'dp'.*once per rank"):
        sync.finish()
    assert started == []
    model.zero_grad(set_to_none=True)
    sync.enabled = False
    model(x).sum().backward()
    sync.enabled = True
    sync.finish()
    _assert_doubled(model, reference)


def test_a_backward_after_one_that_raised_sums_afresh():
    """A backward that raises once some buckets have started never reaches its end: the next one waits for
    those sums, drops them and counts its own gradients afresh, so it sums every bucket once, in order, and
    its gradients are exactly the two ranks' sum. (Counted on, the stale counts would start buckets before
    their gradients were in, and refuse the rest as late.)"""
    model, _, x, reference, sync, started = _bucketed(unused=False)  # every one trained: buckets start early
    first = model[0].weight  # the gradient backward makes last: raise there, after later buckets started
    handle = first.register_hook(lambda g: (_ for _ in ()).throw(ValueError("stop")))
    with pytest.raises(ValueError, match="stop"):
        model(x).sum().backward()
    handle.remove()
    assert 0 < len(started) < len(sync.buckets)
    model.zero_grad(set_to_none=True)
    started.clear()
    model(x).sum().backward()
    assert started == [len(b.params) for b in sync.buckets]
    _assert_doubled(model, reference)


class _caps:
    """Bucket limits for a test, restored after."""

    def __init__(self, first: int, cap: int):
        self.limits = first, cap

    def __enter__(self):
        self.saved = _patched(*self.limits)

    def __exit__(self, *exc):
        _restore(self.saved)
