"""One torchrun job of the tensor-parallel benchmark (run by bench_tp.py, not by hand).

Every rank builds the same Llama-style model twice from the same initial
values: compiled by meshlib, and with torch's own `parallelize_module`
(Colwise/Rowwise plans, vocab-parallel embedding and head, `loss_parallel`).
It checks both against each other, counts the bytes each moves in one step,
then times training steps of the two, alternating, and rank 0 writes JSON.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from meshlib import Mesh
from meshlib_torch import COUNTER, data, models, parallelize
from meshlib_torch.runtime import dist as mdist
from meshlib_torch.runtime.materialize import init_full

_FUNCOL = torch.ops._c10d_functional


class CommBytes(TorchDispatchMode):
    """Bytes per rank of every functional collective DTensor issues (the same payload rule as meshlib's counter)."""

    def __init__(self):
        super().__init__()
        self.by_kind: dict = {}
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower itself to collectives first
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        kinds = {
            _FUNCOL.all_reduce: ("all_reduce", 1),
            _FUNCOL.all_gather_into_tensor: ("all_gather", None),
            _FUNCOL.reduce_scatter_tensor: ("reduce_scatter", 1),
            _FUNCOL.all_to_all_single: ("all_to_all", 1),
        }
        if packet in kinds:
            kind, scale = kinds[packet]
            x = args[0]
            n = args[1] if kind == "all_gather" else 1
            key = (self.phase, kind)
            self.by_kind[key] = self.by_kind.get(key, 0) + x.numel() * x.element_size() * (scale or n)
        return out


def _init(cfg):
    cls = models.model_class(cfg)
    return lambda name: cls.param_init(name, cfg)


def native_model(cfg, tp_mesh, seed: int, dtype, sp: bool) -> torch.nn.Module:
    """The same model with torch's tensor parallel plans, written as torchtitan writes them for Llama."""
    model = models.build(cfg, device="cpu", dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_full(name, tuple(p.shape), dtype, _init(cfg), seed))
    model.init_buffers()
    seq = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=not sp),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(cfg.n_layers):
        layer = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
        layer.update({f"feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")})
        layer["attention.wo"] = RowwiseParallel(output_layouts=seq, use_local_output=not sp)
        layer["feed_forward.w2"] = RowwiseParallel(output_layouts=seq, use_local_output=not sp)
        if sp:
            layer["attention_norm"] = SequenceParallel()
            layer["ffn_norm"] = SequenceParallel()
            layer["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            )
            layer["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        plan.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    parallelize_module(model, tp_mesh, plan)
    n = tp_mesh.size()
    for layer in model.layers:
        layer.attention.n_heads //= n  # local heads, as torchtitan does
        layer.attention.n_kv_heads //= n
    return model


def _native_step(model, opt, tokens, targets, meter: CommBytes | None = None):
    with loss_parallel():
        if meter:
            meter.phase = "forward"
        loss = model(tokens, targets)
        if meter:
            meter.phase = "backward"
        loss.backward()
    opt.step()
    opt.zero_grad()
    return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach())


def _ours_step(par, opt, tokens, targets):
    loss = par(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _timed(fn, steps: int, batches) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        fn(*batches[i % len(batches)])
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / steps


def main(model_name: str, tp: int, batch: int, seq: int, rounds: int, steps: int, sp: bool, out: str) -> None:
    mdist.init(timeout=300)
    torch.manual_seed(0)
    cfg = models.config(model_name)
    dtype = torch.float32
    mesh = Mesh(tp=tp)
    batches = [data.batch(i, batch_size=batch, seq_len=seq) for i in range(4)]
    meta = models.build(cfg, device="meta", dtype=dtype)
    t0 = time.perf_counter()
    ours = parallelize(
        meta,
        mesh=mesh,
        rules=models.default_rules(cfg, mesh),
        example_inputs=batches[0],
        init=_init(cfg),
        sequence_parallel=sp,
    )
    build_ours = time.perf_counter() - t0
    native = native_model(cfg, mdist.device_mesh(mesh), seed=0, dtype=dtype, sp=sp)
    opt_ours, opt_native = _opt(ours.parameters()), _opt(native.parameters())

    # the same first step from the same start: both must agree
    COUNTER.reset()
    loss_ours = _ours_step(ours, opt_ours, *batches[0])
    ours_bytes = {(ph, k): b for (ph, k, _), b in COUNTER.by_kind.items()}
    meter = CommBytes()
    with meter:
        loss_native = _native_step(native, opt_native, *batches[0], meter=meter)

    times_ours, times_native = [], []
    for r in range(rounds):
        order = [
            ("ours", lambda t, y: _ours_step(ours, opt_ours, t, y)),
            ("native", lambda t, y: _native_step(native, opt_native, t, y)),
        ]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            (times_ours if name == "ours" else times_native).append(_timed(fn, steps, batches))
    if dist.get_rank() == 0:
        result = {
            "model": model_name, "tp": tp, "batch": batch, "seq": seq, "sp": sp, "dim": cfg.dim, "layers": cfg.n_layers,
            "loss_ours": loss_ours, "loss_native": loss_native,
            "bytes_ours": {f"{p}/{k}": b for (p, k), b in ours_bytes.items()},
            "bytes_native": {f"{p}/{k}": b for (p, k), b in meter.by_kind.items()},
            "step_ours": times_ours, "step_native": times_native, "build_ours_s": build_ours,
            "plan_collectives": len(ours.plan.collectives),
        }  # fmt: skip
        with open(out, "w") as f:
            json.dump(result, f)
    mdist.shutdown()


if __name__ == "__main__":
    m, tp, b, s, rounds, steps, sp, out = sys.argv[1:9]
    main(m, int(tp), int(b), int(s), int(rounds), int(steps), sp == "sp", out)

