"""meshlib: declare how every tensor is laid out over a named device mesh.

The core is pure Python (optree and einops); it never imports torch. The
torch backend, `meshlib_torch`, compiles and runs what the core declares.
"""

from ._backend import backend
from .cost import ModelState, dp_comm_bytes, fsdp2_memory, min_max_partition, tp_comm_bytes, zero_level, zero_memory
from .devices import A100, H100, DeviceProfile, Link, device_profile
from .mesh import CANONICAL_AXES, Mesh
from .options import Parallelism, Pipelining, Running
from .plan import Boundary, Collective, Kept, Memory, Plan, Precision, Stage
from .planned import predict_plan, workload_of
from .planner import Candidate, search
from .predict import Prediction, predict
from .rules import LogicalRules, PatternRules, Rule, apply_rules, compose, dims, logical_rules, pattern_rules
from .schedules import (
    ACTION_KINDS,
    SCHEDULE_NAMES,
    Action,
    Schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule,
    zb_h1,
    zbv,
)
from .sharding import UNEVEN_POLICIES, NamedSharding
from .simulation import Simulation, bubble_formula, gantt, simulate, validate_schedule
from .spec import UNCONSTRAINED, P
from .transformer import ModelShape, StepConfig
from .tree import (
    ShapeDtype,
    flatten_dotted,
    flatten_with_paths,
    tree_shardings,
    unflatten_dotted,
)
from .visualize import Layout, layout
from .workload import Comm, Compute, StageCompute, StageWork, Workload

PartitionSpec = P

__version__ = "0.1.0"

__all__ = [
    "A100",
    "ACTION_KINDS",
    "Action",
    "Boundary",
    "CANONICAL_AXES",
    "Candidate",
    "Collective",
    "Comm",
    "Compute",
    "DeviceProfile",
    "H100",
    "Kept",
    "Layout",
    "Link",
    "LogicalRules",
    "Memory",
    "Mesh",
    "ModelShape",
    "ModelState",
    "NamedSharding",
    "P",
    "Parallelism",
    "PartitionSpec",
    "PatternRules",
    "Pipelining",
    "Plan",
    "Precision",
    "Prediction",
    "Rule",
    "Running",
    "SCHEDULE_NAMES",
    "Schedule",
    "ShapeDtype",
    "Simulation",
    "Stage",
    "StageCompute",
    "StageWork",
    "StepConfig",
    "UNCONSTRAINED",
    "UNEVEN_POLICIES",
    "Workload",
    "apply_rules",
    "backend",
    "bubble_formula",
    "compose",
    "device_profile",
    "dims",
    "dp_comm_bytes",
    "flatten_dotted",
    "flatten_with_paths",
    "fsdp2_memory",
    "gantt",
    "gpipe",
    "interleaved_1f1b",
    "layout",
    "logical_rules",
    "min_max_partition",
    "one_f_one_b",
    "pattern_rules",
    "predict",
    "predict_plan",
    "schedule",
    "search",
    "simulate",
    "tp_comm_bytes",
    "tree_shardings",
    "unflatten_dotted",
    "validate_schedule",
    "workload_of",
    "zb_h1",
    "zbv",
    "zero_level",
    "zero_memory",
]
