"""Host time per op as meshlib's runtime spends it: a tiny compiled model's step on one rank.

`compute.host_times` measures torch's own cost of a tiny op (the dispatcher, autograd). A compiled model
pays more per op: its graph runs through fx's generated code and meshlib's modules, parameters enter as
DTensors and leave as local tensors, and the update steps one DTensor at a time (each op through DTensor's
dispatch). Where the tensors are tiny, that cost is the whole step, so this benchmark compiles a bundled
Llama with every width 8 on a one-rank mesh, times its forward and backward and its update (`timed`), and
divides each by the ops the plan's dry run counts for it (`Plan.compute`: forward and backward ops per
microbatch, the update's ops). The arithmetic of 8-wide tensors takes nanoseconds per op: what is left is
the host's time per op of each kind.

The same Llama at a working width (`WIDE`: 192 wide, 512 tokens a step) measures what the ops that are not
matrix products reach as a model runs them: fresh activations kept for backward, cold caches, transposed
and strided copies, transcendental elementwise ops (SiLU, exp). Its forward and backward are timed with
the dry run's counts beside them (`model`), and `fit.fit_model_memory` reads the memory efficiency off it.
"""

from __future__ import annotations

import torch

from meshlib import Mesh

from .compute import timed

__all__ = ["TINY", "WIDE", "runtime_times"]

TINY = {"vocab_size": 256, "dim": 8, "n_layers": 2, "n_heads": 2, "hidden_dim": 8, "max_seq_len": 8}
WIDE = ({"vocab_size": 256, "dim": 192, "n_layers": 2, "n_heads": 6, "hidden_dim": 512, "max_seq_len": 128}, 4)


def runtime_times(*, target: float = 0.02, batches: int = 5, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """`{what: (fastest, median) seconds per op}` on a one-rank mesh (run on a pool of one rank), each the
    least over `rounds` interleaved rounds of `timed` (this machine's speed drifts by a third over seconds):

    - `graph_op`: the forward and backward of one microbatch over the ops the dry run counts in them;
    - `update_op`: one optimizer step (meshlib's AdamW over DTensor parameters) over its counted ops.
    Both also as `ops.graph`, `ops.update`: the counts (fastest = median). `model`: the `WIDE` Llama's forward
    and backward, its `seconds` (fastest, median) and its dry run's `matmuls`, fused attention calls
    (`attention`) and other fused `flops`, other ops' `bytes` and their count `ops`."""
    from ..compiler.compile import compile_model
    from ..data import batch
    from ..models import build, config, default_rules, model_class
    from ..runtime.parallelize import parallelize

    torch.set_num_threads(1)

    def step(widths: dict, batch_size: int):
        """(plan's compute of one rank, forward-and-backward, update) of the Llama of `widths` on one rank."""
        cfg = config("llama-tiny", **widths)
        mesh = Mesh(dp=1)
        example = batch(0, batch_size=batch_size, seq_len=widths["max_seq_len"])
        rules = default_rules(cfg, mesh)
        with torch.device("meta"):
            plan = compile_model(build(cfg), mesh=mesh, rules=rules, example_inputs=example,
                                 estimate_memory=True).plan  # fmt: skip
        cls = model_class(cfg)
        with torch.device("meta"):
            module = build(cfg)
        model = parallelize(module, mesh=mesh, rules=rules, example_inputs=example,
                            init=lambda n: cls.param_init(n, cfg))  # fmt: skip
        opt = model.optimizer(lr=1e-4)

        def forward_backward():  # as a training step runs them: gradients start from None
            opt.zero_grad()
            model(*example).backward()

        return plan.compute[0], forward_backward, opt.step

    work, forward_backward, update = step(TINY, 1)
    graph_ops, update_ops = work.forward.op_count + work.backward.op_count, work.optimizer.op_count
    wide, wide_fb, _ = step(*WIDE)
    runs = []
    for _ in range(rounds):  # interleaved rounds: a slow spell of the machine touches one round of each
        runs.append([timed(fn, target=target, batches=batches) for fn in (forward_backward, update, wide_fb)])
    fb, up, seconds = (tuple(min(r[i][k] for r in runs) for k in (0, 1)) for i in range(3))
    passes = (wide.forward, wide.backward)
    model = {"seconds": seconds,
             "matmuls": [list(mm) for c in passes for mm in c.matmuls], "flops": sum(c.flops for c in passes),
             "attention": [list(a) for c in passes for a in c.attention],
             "bytes": sum(c.bytes for c in passes), "ops": sum(c.ops for c in passes)}  # fmt: skip
    return {
        "graph_op": tuple(t / graph_ops for t in fb), "update_op": tuple(t / update_ops for t in up),
        "ops.graph": (float(graph_ops), float(graph_ops)), "ops.update": (float(update_ops), float(update_ops)),
        "model": model,
    }  # fmt: skip
