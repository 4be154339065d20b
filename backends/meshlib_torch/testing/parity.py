"""The parity harness: the same training run on N ranks and in one process, compared.

`train_parallel` runs on every rank (under torchrun or a `RankPool`) and
returns, on every rank, the per-step losses and gradient norms and the full
parameters after the last step. `train_reference` runs the unsharded model in
this process with the same initial values, data and optimizer. `compare`
checks them within the dtype's tolerance: fp64 rtol/atol 1e-12; fp32 rtol
1e-5 with torch.testing's fp32 atol of 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshlib import Mesh

from .. import data, models
from ..runtime.materialize import init_full
from ..runtime.parallel import parallelize

# (rtol, atol): DESIGN.md's contract; fp32's atol is torch.testing's default for fp32.
TOLERANCE = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@dataclass
class RunConfig:
    model: str = "gpt-tiny"
    mesh: str = "dp=2,tp=2"
    steps: int = 3
    batch_size: int = 4
    seq_len: int = 16
    dtype: str = "float64"
    lr: float = 1e-2
    seed: int = 0
    sequence_parallel: bool = False
    overrides: dict = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    plan: object = None
    comm: dict | None = None


def _init(cfg):
    model_cls = models.model_class(cfg)
    return lambda name: model_cls.param_init(name, cfg)


def _optimizer(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def train_reference(run: RunConfig) -> RunResult:
    cfg = models.config(run.model, **run.overrides)
    model = models.build(cfg, device="cpu", dtype=run.torch_dtype)
    init = _init(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_full(name, tuple(p.shape), run.torch_dtype, init, run.seed))
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    opt = _optimizer(model.parameters(), run.lr)
    losses, norms = [], []
    for step in range(run.steps):
        tokens, targets = data.batch(step, batch_size=run.batch_size, seq_len=run.seq_len, seed=run.seed)
        loss = model(tokens, targets)
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return RunResult(losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()})


def train_parallel(run: RunConfig, *, progress: bool = False) -> RunResult:
    """Call on every rank; every rank returns the same result. `progress` shows a bar with the loss."""
    from ..runtime.comm import COUNTER

    cfg = models.config(run.model, **run.overrides)
    mesh = Mesh.parse(run.mesh)
    meta = models.build(cfg, device="meta", dtype=run.torch_dtype)
    example = data.batch(0, batch_size=run.batch_size, seq_len=run.seq_len, seed=run.seed)
    par = parallelize(
        meta,
        mesh=mesh,
        rules=models.default_rules(cfg, mesh),
        example_inputs=example,
        init=_init(cfg),
        seed=run.seed,
        sequence_parallel=run.sequence_parallel,
    )
    opt = _optimizer(par.parameters(), run.lr)
    losses, norms = [], []
    with _Progress(run.steps, f"{run.model} on {run.mesh}", enabled=progress) as bar:
        for step in range(run.steps):
            tokens, targets = data.batch(step, batch_size=run.batch_size, seq_len=run.seq_len, seed=run.seed)
            COUNTER.reset()
            loss = par(tokens, targets)
            loss.backward()
            comm = COUNTER.snapshot()
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in par.parameters()]).full_tensor()))
            losses.append(float(loss.detach()))
            opt.step()
            opt.zero_grad()
            bar.step(step, losses[-1], norms[-1])
    params = {_fqn(n): p.full_tensor().detach().clone() for n, p in par.named_parameters()}
    return RunResult(losses, norms, params, par.plan, comm)


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
                self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
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
        torch.testing.assert_close(par.params[name], ref.params[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
