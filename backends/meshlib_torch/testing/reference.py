"""Parity for any model: the same training on N ranks and in one process, compared.

A `Trial` names how to build the model (a module-level function that builds
the same model, with the same weights, every time it is called), each step's
global batch, the mesh, the rules and the options. `run_parallel` runs on
every rank (under a `RankPool` or torchrun): it builds the model, hands it to
`parallelize` with its own weights, and trains `steps` AdamW steps. It
returns the losses, the gradients of the first step and the parameters after
the last, every one whole (gathered from the shards). `run_single` trains the
unmodified model in this process with torch's own AdamW and the same settings.
`assert_same` compares them within a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshlib import Mesh, P, pattern_rules

from ..compiler.capture.call import batch_call, pick_loss

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1


@dataclass
class Trial:
    build: Callable[[], torch.nn.Module]  # module-level: the same model and weights on every call
    batch: Callable[[int], tuple | dict]  # module-level: the global batch of step i
    mesh: str = "dp=2"
    rules: Callable[[Mesh], object] | None = None  # module-level: mesh -> rules (None: all replicated)
    steps: int = 3
    lr: float = 1e-3
    loss: int | str | None = None
    options: dict = field(default_factory=dict)  # more parallelize arguments (zero, microbatches, ...)
    optimizer: type = torch.optim.AdamW  # any torch.optim class, built with `optimizer_options` and lr
    optimizer_options: dict | None = None  # None: AdamW's betas, eps and weight decay below
    scheduler: Callable | None = None  # module-level: optimizer -> a torch LR scheduler, stepped after each step
    after_step: Callable | None = None  # module-level: model -> None, run by the reference after each update
    buffers: tuple[str, ...] = ()  # buffers (by name ending) compared too: e.g. balancing biases
    max_norm: float | None = None  # clip the gradients to this global norm before each update (torch's own, here)

    def make_optimizer(self, build):
        options = self.optimizer_options
        if options is None:
            options = dict(betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        return build(self.optimizer, lr=self.lr, **options)


@dataclass
class Trace:
    losses: list[float]
    grads: dict[str, torch.Tensor]  # after the first step's backward, before its update
    params: dict[str, torch.Tensor]  # after the last step
    plan: object = None
    comm: dict | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the trial's `buffers`, after the last step


def run_single(trial: Trial) -> Trace:
    """The unmodified model in one process: torch.optim.AdamW with `parallelize`'s optimizer settings."""
    model = trial.build()
    params = dict(model.named_parameters())
    opt = trial.make_optimizer(lambda cls, **kw: cls(params.values(), foreach=False, **kw))
    sched = trial.scheduler(opt) if trial.scheduler else None
    losses, grads = [], {}
    for step in range(trial.steps):
        args, kwargs = batch_call(trial.batch(step))
        loss = pick_loss(model(*args, **kwargs), trial.loss)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        if trial.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params.values(), trial.max_norm)
        opt.step()
        opt.zero_grad()
        if trial.after_step is not None:
            trial.after_step(model)
        if sched is not None:
            sched.step()
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if trial.buffers and n.endswith(trial.buffers)}
    return Trace(losses, grads, {n: p.detach().clone() for n, p in params.items()}, buffers=buffers)


class _Recording:
    """An optimizer that notes the whole gradients the first time it steps, or before that reduces
    them for clipping (a pipeline steps inside `train_step`, after its gradients are summed)."""

    def __init__(self, opt, params, whole):
        self.opt, self.params, self.whole, self.grads = opt, params, whole, None

    def __getattr__(self, name):
        return getattr(self.opt, name)

    def _note(self) -> None:
        if self.grads is None:
            held = {n: p.grad for n, p in self.params().items() if p.grad is not None}
            self.grads = {n: _whole(self.whole, n, g) for n, g in held.items()}  # ZeRO-1's: Partial, summed

    def reduce_gradients(self):
        self._note()
        return self.opt.reduce_gradients()

    def step(self):
        self._note()
        return self.opt.step()


def parallelize_trial(trial: Trial):
    """The trial's model, built and parallelized on its mesh with its rules and options (on every rank)."""
    from ..runtime.parallelize import parallelize

    mesh = Mesh.parse(trial.mesh)
    rules = trial.rules(mesh) if trial.rules is not None else pattern_rules({}, default=P())
    return parallelize(
        trial.build(), mesh=mesh, rules=rules, example_inputs=trial.batch(0), loss=trial.loss, **trial.options
    )


def run_parallel(trial: Trial) -> Trace:
    """Call on every rank; every rank returns the same whole losses, gradients and parameters."""
    from ..runtime.comm import COUNTER

    par = parallelize_trial(trial)
    opt = _Recording(trial.make_optimizer(par.optimizer), par.named_model_parameters, par.whole)
    sched = trial.scheduler(opt.opt) if trial.scheduler else None
    losses, comm = [], None
    for step in range(trial.steps):
        COUNTER.reset()
        losses.append(float(par.train_step(trial.batch(step), opt, max_norm=trial.max_norm)))
        comm = COUNTER.snapshot()
        if sched is not None:
            sched.step()
    mine = {n: _whole(par.whole, n, p) for n, p in par.named_model_parameters().items()}
    if getattr(opt.opt, "master", None):  # fp32 masters are the parameters' true values
        mine.update({n: _whole(par.whole, n, m) for n, m in opt.opt.master.items() if n in mine})
    grads, params = _from_every_rank(opt.grads), _from_every_rank(mine)
    held = par.named_model_buffers().items() if trial.buffers else ()
    buffers = _from_every_rank({n: b.detach().clone() for n, b in held if n.endswith(trial.buffers)})
    return Trace(losses, grads, params, par.plan, comm, buffers)


def _whole(whole, name: str, t: torch.Tensor) -> torch.Tensor:
    """`Parallel.whole`: gathered by DTensor, rows held in rank order put back in the model's order."""
    return whole(name, t).detach().clone()


def _from_every_rank(part: dict) -> dict:
    """Every rank's entries (pipeline ranks hold different stages)."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, part)
    out = {}
    for p in everyone:
        out.update(p)
    return out


def assert_same(ref: Trace, par: Trace, *, rtol: float, atol: float, loss_tol: float | None = None) -> dict[str, float]:
    """Raise naming what differs; else the largest differences of loss, gradient and parameter. `loss_tol`: the
    losses' tolerance where the model computes its loss in a lower precision than the rest (transformers casts
    the logits to fp32 for the loss, so an fp64 model's loss holds fp32's 7 digits)."""
    tol = (rtol, atol) if loss_tol is None else (loss_tol, loss_tol)
    torch.testing.assert_close(torch.tensor(par.losses), torch.tensor(ref.losses), rtol=tol[0], atol=tol[1])
    pairs = (("grad", par.grads, ref.grads), ("param", par.params, ref.params), ("buffer", par.buffers, ref.buffers))
    for kind, a, b in pairs:
        assert sorted(a) == sorted(b), f"{kind} names differ: {sorted(set(a) ^ set(b))}"
        for name in b:
            say = lambda m, n=name, k=kind: f"{k} {n}: {m}"  # noqa: E731
            torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=say)
    worst = lambda a, b: max(float((a[n] - b[n]).abs().max()) for n in b)  # noqa: E731
    return {
        "loss": max(abs(x - y) for x, y in zip(par.losses, ref.losses)),
        "grad": worst(par.grads, ref.grads),
        "param": worst(par.params, ref.params),
    }


__all__ = ["Trace", "Trial", "assert_same", "run_parallel", "run_single"]
