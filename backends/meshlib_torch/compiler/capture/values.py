"""Values: every node's global value (shape, dtype, requires_grad), and its forward FLOPs.

The normalized graph runs once on meta tensors (or fake ones, for a model with
real weights: the weights are read as fake copies, so the recorded values
never hold them), each node under its region's grad and autocast modes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from ...torch_private import FakeTensorMode
from .call import Call
from .regions import run_node_in_region


class _Recorder(fx.Interpreter):
    """Runs the graph, noting each node's value and, with a `FlopCounterMode`, its forward FLOPs."""

    def __init__(self, gm: fx.GraphModule, flops=None, fake: FakeTensorMode | None = None):
        super().__init__(gm)
        self.flops, self.fake = flops, fake

    def fetch_attr(self, target: str):
        # a fake copy of a real weight: the values recorded never reach (or keep alive) the weights
        attr = super().fetch_attr(target)
        return self.fake.from_tensor(attr) if self.fake is not None and torch.is_tensor(attr) else attr

    def run_node(self, n: fx.Node):
        before = self.flops.get_total_flops() if self.flops is not None else 0
        out = run_node_in_region(n, lambda: super(_Recorder, self).run_node(n))
        n.meta["val"] = out
        if self.flops is not None:
            n.meta["flops"] = self.flops.get_total_flops() - before
        return out


def annotate_values(gm: fx.GraphModule, call: Call, *, count_flops: bool = False) -> None:
    """Run `gm` on meta or fake tensors: every node gets `meta["val"]` (global shapes) and, with
    `count_flops`, `meta["flops"]` (its forward FLOPs, by torch's FlopCounterMode: the pipeline's
    stage cost, counted from shapes alone)."""
    from torch.utils.flop_counter import FlopCounterMode

    tensors = list(gm.parameters()) + list(gm.buffers())
    inputs = list(call.tensors.values())
    counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
    if tensors and all(t.is_meta for t in tensors):
        # meta kernels alone are several times faster than fake tensors (autocast regions: see regions.py)
        with counter:
            _Recorder(gm, counter if count_flops else None).run(*(torch.empty_like(x, device="meta") for x in inputs))
        return
    device = tensors[0].device if tensors else torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, counter:
        fakes = [mode.from_tensor(torch.empty_like(x, device=device)) for x in inputs]
        _Recorder(gm, counter if count_flops else None, mode).run(*fakes)


class _Dtypes(fx.Interpreter):
    """Runs the graph on meta tensors with floating parameters and buffers in `compute`, noting
    the dtype each value has when the model runs in that precision (`meta["run_dtype"]`)."""

    def __init__(self, gm: fx.GraphModule, compute: torch.dtype, keep=frozenset()):
        super().__init__(gm)
        self.compute, self.keep = compute, keep
        self.state = {id(t) for t in [*gm.parameters(), *gm.buffers()]}

    def fetch_attr(self, target: str):
        attr = super().fetch_attr(target)
        if not torch.is_tensor(attr):
            return attr
        lowered = id(attr) in self.state and attr.is_floating_point() and target not in self.keep
        dtype = self.compute if lowered else attr.dtype
        return torch.empty_like(attr, device="meta", dtype=dtype)

    def run_node(self, n: fx.Node):
        out = run_node_in_region(n, lambda: super(_Dtypes, self).run_node(n))
        if torch.is_tensor(out):
            n.meta["run_dtype"] = out.dtype
            if not out.is_meta:  # a tensor the graph makes on the tracing device (a mask): meta like the rest
                out = torch.empty_like(out, device="meta")
        return out


def annotate_run_dtypes(gm: fx.GraphModule, call: Call, compute: torch.dtype, keep=frozenset()) -> None:
    """Each value's dtype when the parameters compute in `compute` (bf16, fp16): `meta["run_dtype"]`.
    What crosses a collective or a stage boundary moves in that dtype; a value the model casts
    itself (a norm's fp32 statistics) keeps its own, and so do the buffers named in `keep`."""
    params = [p for p in gm.parameters() if p.is_floating_point()]
    if not params or all(p.dtype == compute for p in params):
        return
    _Dtypes(gm, compute, keep).run(*(torch.empty_like(x, device="meta") for x in call.tensors.values()))


def run_dtype(node: fx.Node) -> torch.dtype:
    """The dtype of `node`'s value as the model runs (see `annotate_run_dtypes`)."""
    return node.meta.get("run_dtype", node.meta["val"].dtype)


__all__ = ["annotate_run_dtypes", "annotate_values", "run_dtype"]
