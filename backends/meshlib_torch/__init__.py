"""meshlib_torch: the torch backend of meshlib.

- `compile_model(model, mesh=..., rules=..., example_inputs=...)` traces a model
  (fx, or torch.export where fx fails), places every value on the mesh and
  inserts only the collectives it needs; no processes, no memory (meta models).
- `parallelize(...)` builds the compiled model on a real DeviceMesh under
  torchrun: DTensor parameters made in their shards, NCCL or gloo collectives.
- `COUNTER` counts the logical bytes each collective moves, per step and rank.
"""

from . import cli  # noqa: E402,F401  (the `meshlib` command finds it here)
from .compiler.compile import Compiled, compile_model
from .runtime.comm import COUNTER, CommCounter
from .runtime.parallel import Parallel, parallelize

__all__ = ["COUNTER", "CommCounter", "Compiled", "Parallel", "compile_model", "parallelize"]
