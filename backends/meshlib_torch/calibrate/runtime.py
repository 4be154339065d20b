"""Host time per op as meshlib's runtime spends it: a tiny compiled model's step on one rank.

`compute.host_times` measures torch's own cost of a tiny op (the dispatcher, autograd). A compiled model
pays more per op: its graph runs through fx's generated code and meshlib's modules, parameters enter as
DTensors and leave as local tensors, and the update steps one DTensor at a time (each op through DTensor's
dispatch). Where the tensors are tiny, that cost is the whole step, so this benchmark compiles a bundled
Llama with every width 8 on a one-rank mesh, times its forward and backward and its update (`timed`), and
divides each by the ops the plan's dry run counts for it (`Plan.compute`: forward and backward ops per
microbatch, the update's ops). The arithmetic of 8-wide tensors takes nanoseconds per op: what is left is
the host's time per op of each kind.
"""

from __future__ import annotations

import torch

from meshlib import Mesh

from .compute import timed

__all__ = ["TINY", "runtime_times"]

TINY = {"vocab_size": 256, "dim": 8, "n_layers": 2, "n_heads": 2, "hidden_dim": 8, "max_seq_len": 8}


def runtime_times(*, target: float = 0.02, batches: int = 5) -> dict[str, tuple[float, float]]:
    """`{what: (fastest, median) seconds per op}` on a one-rank mesh (run on a pool of one rank):

    - `graph_op`: the forward and backward of one microbatch over the ops the dry run counts in them;
    - `update_op`: one optimizer step (meshlib's AdamW over DTensor parameters) over its counted ops.
    Both also as `ops.graph`, `ops.update`: the counts (fastest = median)."""
    from ..compiler.compile import compile_model
    from ..data import batch
    from ..models import build, config, default_rules, model_class
    from ..runtime.parallelize import parallelize

    torch.set_num_threads(1)
    cfg = config("llama-tiny", **TINY)
    mesh = Mesh(dp=1)
    example = batch(0, batch_size=1, seq_len=TINY["max_seq_len"])
    rules = default_rules(cfg, mesh)
    with torch.device("meta"):
        plan = compile_model(build(cfg), mesh=mesh, rules=rules, example_inputs=example,
                             estimate_memory=True).plan  # fmt: skip
    work = plan.compute[0]
    graph_ops, update_ops = work.forward.op_count + work.backward.op_count, work.optimizer.op_count
    cls = model_class(cfg)
    with torch.device("meta"):
        module = build(cfg)
    model = parallelize(module, mesh=mesh, rules=rules, example_inputs=example, init=lambda n: cls.param_init(n, cfg))
    opt = model.optimizer(lr=1e-4)

    def forward_backward():  # as a training step runs them: gradients start from None
        opt.zero_grad()
        model(*example).backward()

    fb = timed(forward_backward, target=target, batches=batches)
    up = timed(opt.step, target=target, batches=batches)
    return {
        "graph_op": tuple(t / graph_ops for t in fb), "update_op": tuple(t / update_ops for t in up),
        "ops.graph": (float(graph_ops), float(graph_ops)), "ops.update": (float(update_ops), float(update_ops)),
    }  # fmt: skip
