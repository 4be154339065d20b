"""The parity harness: the same training run on N ranks and in one process, compared.

`train_parallel` runs on every rank (under torchrun or a `RankPool`) and
returns, on every rank, the per-step losses and gradient norms and the full
parameters after the last step. `train_reference` runs the unsharded model in
this process with the same initial values, data and optimizer. `compare`
checks them within the dtype's tolerance: fp64 rtol/atol 1e-12; fp32 rtol
1e-5 with torch.testing's fp32 atol of 1e-5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from meshlib import Mesh, Parallelism, Pipelining, Precision, Running

from .. import data, models
from ..runtime.hub import export, load_into
from ..runtime.materialize import init_full
from ..runtime.optim import LossScaler
from ..runtime.parallelize import parallelize

# (rtol, atol) by the dtype the model computes in (`RunConfig.tolerance`). fp64 and fp32: the project's
# parity contract; fp32's atol is torch.testing's default for fp32. bf16 and fp16: the reference computes in
# the same low precision with fp32 masters (`train_reference`), so the two runs differ only in the order
# of their sums, each rounded to the low precision: bf16 keeps 8 significant bits (a rounding step of
# 2**-8, 3.9e-3, relative) and fp16 11 (4.9e-4); a few such steps over 3 steps is 2e-2 and 5e-3.
TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


_PAR, _PIPE, _RUN = Parallelism(), Pipelining(), Running()  # the options' defaults, defined once


@dataclass
class RunConfig:
    model: str = "gpt-tiny"
    mesh: str = "dp=2,tp=2"
    steps: int = 3
    batch_size: int = 4
    seq_len: int = 16
    dtype: str = "float64"
    lr: float = 1e-2
    max_norm: float | None = None  # clip the gradients' global norm to this before each update
    seed: int = 0
    overrides: dict = field(default_factory=dict)
    precision: str = ""  # "" computes in `dtype`; else e.g. "bf16" (meshlib.Precision.parse)
    # the parallelize options a run may set (their meanings and checks: meshlib.options)
    sequence_parallel: bool = _PAR.sequence_parallel
    zero: int = _PAR.zero
    recompute: str = _PAR.recompute
    replicate_axes: tuple = _PAR.replicate_axes
    idle_axes: tuple = _PAR.idle_axes
    uneven: str = _PAR.uneven
    capacity_factor: float | None = _PAR.capacity_factor
    cp_method: str = _PAR.cp_method
    cp_layout: str = _PAR.cp_layout
    offload: bool = _RUN.offload
    microbatches: int = _PIPE.microbatches
    schedule: str = _PIPE.schedule
    chunks: int | None = _PIPE.chunks
    split_points: tuple[int, ...] | None = _PIPE.split_points
    balance: str = _PIPE.balance
    model_class: type | None = None  # built instead of the bundled model's class (same config), e.g. a test's variant
    weights: str | None = None  # a checkpoint to start from (safetensors or DCP), instead of the model's init
    export: str | None = None  # after training, write the model there as Hugging Face safetensors

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in: the run's dtype unless `precision` lowers it."""
        return getattr(torch, Precision.parse(self.precision).param) if self.precision else self.torch_dtype

    @property
    def tolerance(self) -> torch.dtype:
        return self.compute_dtype if self.compute_dtype in (torch.bfloat16, torch.float16) else self.torch_dtype


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    plan: object = None
    comm: dict | None = None
    routing: list = field(default_factory=list)  # `Routing.statistics()` of the last step (MoE models)
    dropped: int | None = None  # pairs capacity mode dropped in the last step, over every rank (None: dropless)


def _init(cfg, run: RunConfig | None = None):
    model_cls = (run and run.model_class) or models.model_class(cfg)
    return lambda name: model_cls.param_init(name, cfg)


def _build(run: RunConfig, cfg, *, device: str, dtype: torch.dtype) -> torch.nn.Module:
    if run.model_class is None:
        return models.build(cfg, device=device, dtype=dtype)
    with torch.device(device):
        return run.model_class(cfg).to(dtype)


def _optimizer(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def train_reference(run: RunConfig) -> RunResult:
    """The unsharded model in this process: same initial values, data and AdamW.

    With a lower compute precision it keeps fp32 masters (as the parallel
    run's optimizer does): the bf16/fp16 model runs forward and backward, its
    gradients update the masters, the masters are rounded back into it. In capacity mode its experts drop
    what the ranks' calls drop (`testing.capacity`).
    """
    cfg = models.config(run.model, **run.overrides)
    compute = run.compute_dtype
    model = _build(run, cfg, device="cpu", dtype=compute)
    if run.capacity_factor is not None:
        from ..compiler.program import default_in_spec
        from .capacity import drop_as_ranks

        mesh = Mesh.parse(run.mesh)
        batch_axes = [a for e in default_in_spec(mesh) for a in ((e,) if isinstance(e, str) else e or ())]
        ranks = math.prod(mesh.axis_size(a) for a in batch_axes)
        drop_as_ranks(model, ranks * run.microbatches, run.capacity_factor)
    init = _init(cfg, run)
    if run.weights:
        start = _build(run, cfg, device="cpu", dtype=run.torch_dtype)
        load_into(start, run.weights)
        masters = {n: p.detach().clone() for n, p in start.named_parameters()}
    else:
        draw = lambda n, p: init_full(n, tuple(p.shape), run.torch_dtype, init, run.seed)  # noqa: E731
        masters = {n: draw(n, p) for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(masters[name])
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    mixed = compute != run.torch_dtype
    targets = [torch.nn.Parameter(m) for m in masters.values()] if mixed else list(model.parameters())
    opt = _optimizer(targets, run.lr)
    scaler = LossScaler() if compute == torch.float16 else None
    out_dtype = getattr(torch, Precision.parse(run.precision).output) if run.precision else run.torch_dtype
    losses, norms = [], []
    for step in range(run.steps):
        tokens, targets_ = data.batch(step, batch_size=run.batch_size, seq_len=run.seq_len, seed=run.seed)
        loss = model(tokens, targets_).to(out_dtype)  # as the parallel model returns it
        (scaler.scale_loss(loss) if scaler else loss).backward()
        scale = scaler.scale if scaler else 1.0
        grads = [p.grad.to(run.torch_dtype) for p in model.parameters()]
        norms.append(float(torch.nn.utils.get_total_norm(grads)) / scale)
        losses.append(float(loss.detach()))
        for t, g in zip(targets if mixed else list(model.parameters()), grads):
            t.grad = g
        stepped = targets if mixed else list(model.parameters())
        if scaler is None or scaler.unscale_and_check([t.grad for t in stepped]):
            if run.max_norm is not None:
                torch.nn.utils.clip_grad_norm_(stepped, run.max_norm)  # torch's own, on the whole model
            opt.step()
            models.update_balancing_bias(model)  # DeepSeek-V3's balancing, as the runtime moves it after an update
        opt.zero_grad()
        model.zero_grad()
        if mixed:
            with torch.no_grad():
                for p, t in zip(model.parameters(), targets):
                    p.copy_(t)
    params = dict(zip(masters, targets)) if mixed else dict(model.named_parameters())
    return RunResult(losses, norms, {n: p.detach().clone().to(run.torch_dtype) for n, p in params.items()})


def train_parallel(run: RunConfig, *, progress: bool = False) -> RunResult:
    """Call on every rank; every rank returns the same result. `progress` shows a bar with the loss.

    One loop for every mesh: `train_step` on the global batch (a pipeline's microbatches, or
    gradient accumulation's), the gradient norm noted before each update."""
    from ..runtime.comm import COUNTER

    par = build_parallel(run)
    opt = par.optimizer(lr=run.lr, betas=(0.9, 0.95), weight_decay=0.1)
    par.track_grad_norm = True
    losses, norms, comm = [], [], None
    title = f"{run.model} on {run.mesh}" + (f" ({run.schedule})" if par.pipeline is not None else "")
    with _Progress(run.steps, title, enabled=progress) as bar:
        for step in range(run.steps):
            COUNTER.reset()
            losses.append(par.train_step(batch_of(run, step), opt, max_norm=run.max_norm))
            norms.append(par.last_grad_norm)
            comm = COUNTER.snapshot()
            bar.step(step, losses[-1], norms[-1])
    if run.export:
        export(par, run.export)
    mine = {n: par.whole(n, p).detach().clone() for n, p in par.named_model_parameters().items()}
    if opt.master:  # the fp32 masters are the parameters' true values
        mine.update({n: par.whole(n, m).detach().clone() for n, m in opt.master.items() if n in mine})
    everyone = [None] * torch.distributed.get_world_size()  # pipeline ranks hold different stages
    torch.distributed.all_gather_object(everyone, mine)
    params = {}
    for part in everyone:
        params.update(part)
    routing = par.routing.statistics() if par.routing is not None else []
    everyone = [None] * torch.distributed.get_world_size()  # a pipeline rank holds its stages' routers
    torch.distributed.all_gather_object(everyone, routing)
    routing = sorted({name: (name, c, r) for part in everyone for name, c, r in part}.values())
    dropped = par.routing.dropped() if par.routing is not None else None
    return RunResult(losses, norms, params, par.plan, comm, routing, dropped)


def build_parallel(run: RunConfig):
    """`run`'s model parallelized on its mesh (call on every rank), from `run.weights` or its init."""
    cfg = models.config(run.model, **run.overrides)
    mesh = Mesh.parse(run.mesh)
    meta = _build(run, cfg, device="meta", dtype=run.torch_dtype)
    return parallelize(
        meta, mesh=mesh, rules=models.default_rules(cfg, mesh), example_inputs=batch_of(run, 0),
        init=None if run.weights else _init(cfg, run), weights=run.weights, seed=run.seed,
        sequence_parallel=run.sequence_parallel, zero=run.zero,
        precision=Precision.parse(run.precision) if run.precision else None, recompute=run.recompute,
        replicate_axes=run.replicate_axes, idle_axes=run.idle_axes, uneven=run.uneven, offload=run.offload,
        microbatches=run.microbatches, schedule=run.schedule, capacity_factor=run.capacity_factor,
        cp_method=run.cp_method, cp_layout=run.cp_layout,
        chunks=run.chunks, balance=run.balance, split_points=list(run.split_points) if run.split_points else None,
    )  # fmt: skip


def batch_of(run: RunConfig, step: int) -> tuple:
    """The global batch of `step`."""
    return data.batch(step, batch_size=run.batch_size, seq_len=run.seq_len, seed=run.seed)


def _fqn(name: str) -> str:
    return name.removeprefix("gm.")


class _Progress:
    """A rich progress bar printing each step's loss (silent when disabled or without rich)."""

    def __init__(self, total: int, title: str, *, enabled: bool):
        self.total, self.title, self.enabled, self._bar = total, title, enabled, None

    def __enter__(self):
        if self.enabled:
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                self._bar = None
            else:
                self._bar = Progress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
                )
                self._bar.__enter__()
                self._task = self._bar.add_task(self.title, total=self.total)
        return self

    def step(self, step: int, loss: float, norm: float) -> None:
        if not self.enabled:
            return
        line = f"step {step:3d}  loss {loss:.5f}  grad norm {norm:.4f}"
        if self._bar is None:
            print(line, flush=True)
            return
        self._bar.console.print(line)
        self._bar.update(self._task, advance=1)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)


def pipeline_sends(results: list[RunResult]) -> tuple[dict[str, int], dict[str, int]]:
    """Pipeline bytes of the last step by phase, summed over every rank of a pipelined run: those
    counted at torch's send ops, and the plan's `send_recv` records (per rank of one pp group)
    times the number of pp groups. Equal when the plan predicts the traffic."""
    plan = results[0].plan
    sent = {"forward": 0, "backward": 0}
    for result in results:
        for (phase, kind, _), nbytes in result.comm["by_kind"].items():
            if kind == "send_recv":
                sent[phase] += nbytes
    records = [c for c in plan.collectives if c.kind == "send_recv"]
    groups = plan.mesh.size // plan.mesh.axis_size(records[0].axes[0]) if records else 0
    planned = {phase: groups * sum(c.total_bytes for c in records if c.phase == phase) for phase in sent}
    return sent, planned


def compare(ref: RunResult, par: RunResult, dtype: torch.dtype, *, check: bool = True) -> dict:
    """Max differences (and "ok": within tolerance); with `check`, raise naming what differs."""
    rtol, atol = TOLERANCE[dtype]
    if not check:
        out = _diffs(ref, par)
        try:
            compare(ref, par, dtype)
            out["ok"] = True
        except AssertionError:
            out["ok"] = False
        return out
    out = _diffs(ref, par)
    _assert_close(ref, par, rtol, atol)
    return out


def _diffs(ref: RunResult, par: RunResult) -> dict:
    out = {"loss": max(abs(a - b) for a, b in zip(ref.losses, par.losses))}
    out["grad_norm"] = max(abs(a - b) for a, b in zip(ref.grad_norms, par.grad_norms))
    missing = sorted(set(ref.params) ^ set(par.params))
    if missing:
        raise AssertionError(f"parameter names differ: {missing}")
    worst = max(ref.params, key=lambda n: float((ref.params[n] - par.params[n]).abs().max()))
    out["param"] = float((ref.params[worst] - par.params[worst]).abs().max())
    return out


def _assert_close(ref: RunResult, par: RunResult, rtol: float, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(par.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(par.grad_norms), torch.tensor(ref.grad_norms), rtol=rtol, atol=atol)
    for name in ref.params:
        torch.testing.assert_close(
            par.params[name], ref.params[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
