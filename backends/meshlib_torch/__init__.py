"""meshlib_torch: the torch backend of meshlib.

- `compile_model(model, mesh=..., rules=..., example_inputs=...)` traces a model
  (fx, or torch.export where fx fails), places every value on the mesh and
  inserts only the collectives it needs; no processes, no memory (meta models).
- `parallelize(...)` builds the compiled model on a real DeviceMesh under
  torchrun: DTensor parameters made in their shards, NCCL or gloo collectives.
- their options are `meshlib.Parallelism`, `Pipelining` and `Running`, each defined once (or keywords).
- `COUNTER` counts the logical bytes each collective moves, per step and rank.
- `checkpoint.save(path, par, opt, step=...)` / `checkpoint.load(path, par, opt)`
  write and read the whole training state with DCP, by the model's own names,
  and reshard on load to another mesh or zero level.
- `PeakTracker` measures peak live tensor bytes (the dry run's reference).
- `export(par, path, config=...)` writes the model back as Hugging Face safetensors
  (`parallelize(..., weights=path)` reads them, or a DCP checkpoint, into shards).
- `shard_map(f, mesh=..., in_specs=..., out_specs=...)` runs per-shard code with JAX's semantics
  (check_vma included), eagerly on the mesh's process groups; `lax` holds its collectives.
"""

from . import cli, lax  # noqa: E402,F401  (the `meshlib` command finds cli here; lax is public)
from .compiler.compile import compile_model
from .compiler.program import Compiled
from .memtrack import PeakTracker
from .planner import auto_plans, compile_candidate, model_shape, parallelize_call, run_command, torch_runtime
from .runtime import checkpoint
from .runtime.comm import COUNTER, CommCounter
from .runtime.hub import export
from .runtime.optim import LossScaler, MeshAdamW, MeshOptimizer
from .runtime.parallel import Parallel
from .runtime.parallelize import parallelize
from .spmd.shard_map import shard_map

__all__ = [
    "COUNTER", "CommCounter", "Compiled", "LossScaler", "MeshAdamW", "MeshOptimizer", "Parallel", "PeakTracker",
    "auto_plans", "checkpoint", "compile_candidate", "compile_model", "export", "lax", "model_shape", "parallelize",
    "parallelize_call", "run_command", "shard_map", "torch_runtime",
]  # fmt: skip
