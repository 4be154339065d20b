"""The rank-side job of the planner's benchmark (run by bench_planner.py through a RankPool, not by hand).

`measure` builds one configuration of a bundled model with `parallelize` (its init, no checkpoint), runs
warm-up steps, then times `steps` training steps (forward, backward, update; a barrier before each, the
slowest rank's time) and the peak of live tensor bytes over one step above the model state
(`PeakTracker`, as the tests measure the plan's peak). It lives in its own module because a RankPool job
pickles by qualified name.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from meshlib import Mesh
from meshlib_torch import PeakTracker, data, models, parallelize


def build(name: str, overrides: dict):
    cfg = models.config(name, **overrides)
    cls = models.model_class(cfg)
    return cfg, (lambda n: cls.param_init(n, cfg))


def measure(name: str, overrides: dict, mesh: str, batch: int, seq: int, options: dict, warmup: int, steps: int):
    """{"times": seconds per step (the slowest rank's, each step alone), "peak": this rank's peak bytes}."""
    torch.use_deterministic_algorithms(False)  # as under plain torchrun
    cfg, init = build(name, overrides)
    m = Mesh.parse(mesh)
    with torch.device("meta"):
        module = models.build(cfg)
    batches = [data.batch(i, batch_size=batch, seq_len=seq) for i in range(2)]
    par = parallelize(module, mesh=m, rules=models.default_rules(cfg, m), example_inputs=batches[0], init=init,
                      **options)  # fmt: skip
    opt = par.optimizer(lr=1e-4)
    for i in range(warmup):
        par.train_step(batches[i % 2], opt)
    times = []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        par.train_step(batches[i % 2], opt)
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    state += list(getattr(opt, "master", {}).values())
    with PeakTracker(device="cpu") as tracker:
        tracker.baseline(list(par.parameters()) + list(par.buffers()) + state)
        par.train_step(batches[0], opt)
    return {"times": times, "median": statistics.median(times), "peak": tracker.peak}
