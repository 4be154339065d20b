"""`meshlib plan --auto`: the planner's search on a torch model, and the winners compiled into full plans.

`model_shape(model)` (`model_shapes`) reads the closed-form shape (`meshlib.transformer.ModelShape`) from a
bundled model's config, a transformers model's `config`, or the module itself; `auto_plans(model, ...)`
searches (`meshlib.planner`) and compiles the best configurations on the meta device, each a `Plan` whose
prediction comes from its own dry run (every op the ranks run, every collective the plan lists).
`run_command` is the `meshlib run` line that trains the plan (a bundled model), `parallelize_call` the
`parallelize` call (a model of the user's own).
"""

from __future__ import annotations

import math

import torch

from meshlib import Plan, device_profile, predict_plan
from meshlib.planner import Candidate, search

from . import models
from .model_shapes import model_shape
from .torch_private import pipeline_keeps_grad_buffers

__all__ = ["auto_plans", "compile_candidate", "model_shape", "no_fit", "parallelize_call", "refine", "run_command",
           "torch_runtime"]


def compile_candidate(
    model, candidate: Candidate, *, rules, batch: int, seq: int, profile, example=None, example_kwargs=None
) -> Plan:
    """The full per-rank plan of `candidate` (compiled on the meta device with its dry run), predicted on
    `profile` from what its ranks compute and move. The model is called as `model(*example,
    **example_kwargs)` (default: token ids and targets, `batch` x `seq`)."""
    from .compiler.compile import compile_model

    c = candidate.config
    mesh = c.mesh
    if example is None and not example_kwargs:
        example = tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    precision = "bf16" if c.dtype == "bfloat16" else ("fp16" if c.dtype == "float16" else None)
    m = batch // (c.dp * c.ep * c.microbatch)
    compiled = compile_model(
        model, mesh=mesh, rules=rules(mesh) if callable(rules) and not _is_rule(rules) else rules,
        example_inputs=example or (), example_kwargs=example_kwargs or None, estimate_memory=True, zero=c.zero,
        recompute=c.recompute,
        sequence_parallel=c.sp, microbatches=m, precision=precision, **_pipeline(c), cp_method=c.cp_method,
        idle_axes=tuple(a for a in mesh.axis_names if mesh.axis_size(a) == 1),
    )  # fmt: skip
    plan = compiled.plan
    return plan.replace(prediction=predict_plan(plan, profile))


def _is_rule(rules) -> bool:
    """Whether `rules` is a rule (path, leaf) -> P rather than a rules factory of the mesh: a rules object
    (meshlib's `pattern_rules`, `logical_rules`, ...), or a function of two required arguments. A function of
    one required argument (`lambda mesh, cfg=cfg: ...`) makes the rules for a mesh."""
    import inspect

    if not (inspect.isfunction(rules) or inspect.ismethod(rules)):
        return callable(rules)
    params = inspect.signature(rules).parameters.values()
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) == 2


def torch_runtime() -> dict:
    """What the installed torch runs differently from `meshlib.planner.MESHLIB_RUNTIME`'s torch 2.13: the
    receive buffers its pipeline stages keep (`StepConfig.recv_buffers`)."""
    return {"recv_buffers": 2 if pipeline_keeps_grad_buffers() else 1}


def _pipeline(c) -> dict:
    if c.pp == 1:
        return {}
    chunks = c.chunks if c.schedule == "interleaved-1f1b" else None
    return {"schedule": c.schedule, "chunks": chunks, "balance": "layers"}  # the split the search priced


def refine(found: list[Candidate], compile, *, limit: float, count: int) -> tuple[list[tuple[Candidate, Plan]], list]:
    """The search's candidates `found` compiled in its order (`compile(candidate)` gives the full `Plan`, with its
    prediction) until `count` fit `limit` bytes per rank by their dry run, which has the last word on memory:
    those `(candidate, plan)` pairs, fastest first by their plans' predicted step (the closed form ranks thousands;
    the dry run counts what the ranks run), and the `(candidate, plan)` pairs that did not fit, in order."""
    fits, over = [], []
    for cand in found:
        plan = compile(cand)
        (fits if plan.prediction.memory <= limit else over).append((cand, plan))
        if len(fits) == count:
            break
    fits.sort(key=lambda cp: cp[1].prediction.step_time)  # stable: a tie keeps the search's order
    return fits, over


def auto_plans(
    model, /, *, devices: int, profile, batch: int, seq: int, rules=None, device_memory: float | None = None,
    top: int = 5, compile_top: int = 1, dtype: str = "bfloat16",
) -> tuple[list[Candidate], list[Plan]]:  # fmt: skip
    """The search's `top` candidates for `model`, and the first `compile_top` of them whose dry run fits the
    device memory compiled into full plans, fastest first by their own predictions (`refine`): the first plan is
    the one to run. `rules`: a function of the mesh (default: a bundled model's own). Raises ValueError when
    none of the `top` fits by its dry run."""
    profile = device_profile(profile)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    bundled = cfg is not None and type(cfg) in {type(c) for c in models.CONFIGS.values()}
    if rules is None and not bundled:
        raise ValueError("auto_plans: give rules= (a function of the mesh) for a model that is not bundled")
    limit = models.max_seq_len(cfg) if bundled else None
    if limit is not None and seq > limit:  # before the search: its plans would fail to compile
        raise ValueError(f"auto_plans: seq={seq} is longer than the model's maximum {limit}. Fix: seq <= {limit}")
    shape = model_shape(model)
    found = search(shape, devices=devices, batch=batch, seq=seq, profile=profile, device_memory=device_memory,
                   dtype=dtype, top=top, runtime=torch_runtime(), explain=top)  # fmt: skip
    if rules is None:
        rules = lambda mesh: models.default_rules(cfg, mesh)  # noqa: E731
    limit = device_memory or profile.memory
    fits, _ = refine(found, lambda c: compile_candidate(model, c, rules=rules, batch=batch, seq=seq, profile=profile),
                     limit=limit, count=compile_top)  # fmt: skip
    if not fits:
        raise ValueError(no_fit(len(found), limit))
    return found, [plan for _, plan in fits]


def no_fit(n: int, limit: float) -> str:
    """Why `--auto` or `auto_plans` stops: none of the search's `n` best fits by its dry run."""
    from meshlib._table import human_bytes

    return (f"none of the {n} best plans fits {human_bytes(limit)} per rank by its dry run (the closed form "
            "underestimated their activations). Fix: more plans (--top, top=), a smaller batch or sequence, or more "
            "devices")  # fmt: skip


def run_command(candidate: Candidate, *, model: str, batch: int, seq: int, devices_per_node: int) -> str:
    """The `meshlib run` line that trains `candidate` (one node's share per `meshlib run`, under torchrun's
    rendezvous on several nodes)."""
    c = candidate.config
    mesh = ",".join(f"{a}={n}" for a, n in zip(c.mesh.axis_names, c.mesh.axis_sizes) if n > 1) or "dp=1"
    world = c.mesh.size
    per_node = min(world, devices_per_node)
    nodes = math.ceil(world / per_node)
    parts = [f"meshlib run --nproc-per-node {per_node}"] + ([f"--nnodes {nodes}"] if nodes > 1 else [])
    parts += [f"--model {model}", f"--mesh {mesh}", f"--batch {batch}", f"--seq {seq}"]
    flags = _options(c, batch).items()
    parts += ["--sp" if k == "sequence_parallel" else f"--{k.replace('_', '-')} {v}" for k, v in flags]
    return " ".join(parts)


def parallelize_call(candidate: Candidate, *, batch: int) -> str:
    """The `meshlib_torch.parallelize` call that trains `candidate` on a model of the user's own (which `meshlib
    run`, a harness of the bundled models, does not build), under torchrun on every rank."""
    c = candidate.config
    mesh = ", ".join(f"{a}={n}" for a, n in zip(c.mesh.axis_names, c.mesh.axis_sizes) if n > 1) or "dp=1"
    opts = [f"{k}={v!r}" for k, v in _options(c, batch).items()]
    return f"parallelize(model, mesh=Mesh({mesh}), rules=rules, example_inputs=batch, {', '.join(opts)})"


def _options(c, batch: int) -> dict:
    """`parallelize`'s options for configuration `c` (`meshlib run` takes each as a flag of the same name)."""
    m = batch // (c.dp * c.ep * c.microbatch)
    opts: dict = {"zero": c.zero}
    opts |= {"recompute": c.recompute} if c.recompute != "none" else {}
    opts |= {"sequence_parallel": True} if c.sp else {}
    opts |= {"microbatches": m} if m > 1 else {}
    if c.pp > 1:
        opts |= {"schedule": c.schedule} | ({"chunks": c.chunks} if c.schedule == "interleaved-1f1b" else {})
        opts |= {"balance": "layers"}  # the split the search priced
    opts |= {"cp_method": c.cp_method} if c.cp > 1 else {}
    opts |= {"precision": "bf16"} if c.dtype == "bfloat16" else {}
    return opts
