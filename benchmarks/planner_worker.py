"""The rank-side job of the planner's benchmark (run by bench_planner.py through a RankPool, not by hand).

`measure` builds one configuration of a bundled model with `parallelize` (its init, no checkpoint), runs
warm-up steps, then times `steps` training steps (forward, backward, update; a barrier before each, the
slowest rank's time) and the peak of live tensor bytes over one step above the model state
(`PeakTracker`, as the tests measure the plan's peak). It lives in its own module because a RankPool job
pickles by qualified name.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshlib import Mesh
from meshlib_torch import PeakTracker, data, models, parallelize


def build(name: str, overrides: dict):
    cfg = models.config(name, **overrides)
    cls = models.model_class(cfg)
    return cfg, (lambda n: cls.param_init(n, cfg))


def measure(name: str, overrides: dict, mesh: str, batch: int, seq: int, options: dict, warmup: int, steps: int):
    """{"times": seconds per step (the slowest rank's, each step alone), "peak": this rank's peak bytes,
    "routing": per router, the tokens per expert this rank routed in the tracked step}."""
    torch.use_deterministic_algorithms(False)  # as under plain torchrun
    cfg, init = build(name, overrides)
    m = Mesh.parse(mesh)
    with torch.device("meta"):
        module = models.build(cfg)
    batches = [data.batch(i, batch_size=batch, seq_len=seq) for i in range(2)]
    par = parallelize(module, mesh=m, rules=models.default_rules(cfg, m), example_inputs=batches[0], init=init,
                      **options)  # fmt: skip
    return _timed(par, batches, warmup, steps)


def _timed(par, batches: list, warmup: int, steps: int) -> dict:
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
    routing = {k: v.tolist() for k, v in par.routing.last.items()} if par.routing is not None else {}
    return {"times": times, "median": statistics.median(times), "peak": tracker.peak, "routing": routing}


# -- transformers' models: built from small configs with random weights (no download), as the tests build them --
HF_SIZES = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=256)  # fmt: skip


def _real_models():
    """The tests' builders and rules of transformers' models (tests/real_models.py), one copy for both."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import real_models

    return real_models


def hf_model(family: str):
    """transformers' `<family>ForCausalLM` (Llama, Qwen2, ...) at `HF_SIZES`, or GPT-2 of the same width."""
    rm, h = _real_models(), HF_SIZES
    if family == "gpt2":
        return rm.build_gpt2(vocab=h["vocab_size"], n_positions=h["max_position_embeddings"], n_embd=h["hidden_size"],
                             n_layer=h["num_hidden_layers"], n_head=h["num_attention_heads"])  # fmt: skip
    return rm.build_hf(family, **h)


def hf_rules(family: str, mesh: Mesh):
    rm = _real_models()
    return rm.rules_gpt2(mesh) if family == "gpt2" else rm.rules_llama(mesh)


def hf_batch(step: int, batch: int, seq: int) -> dict:
    """Keyword inputs, as a Hugging Face training loop passes them (the tests' `hf_batch`)."""
    return _real_models().hf_batch(step, HF_SIZES["vocab_size"], batch, seq)


def measure_hf(family: str, mesh: str, batch: int, seq: int, options: dict, warmup: int, steps: int) -> dict:
    """`measure` for transformers' `family`, its weights its own random init."""
    torch.use_deterministic_algorithms(False)
    m = Mesh.parse(mesh)
    batches = [hf_batch(i, batch, seq) for i in range(2)]
    par = parallelize(hf_model(family), mesh=m, rules=hf_rules(family, m), example_kwargs=batches[0], **options)
    return _timed(par, batches, warmup, steps)
