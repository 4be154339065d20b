"""meshlib: declare how every tensor is laid out over a named device mesh.

The core is pure Python (optree and einops); it never imports torch. The
torch backend, `meshlib_torch`, compiles and runs what the core declares.
"""

from ._backend import backend
from .mesh import CANONICAL_AXES, Mesh
from .plan import Boundary, Collective, Memory, Plan, Precision, Stage
from .rules import LogicalRules, PatternRules, Rule, compose, dims, logical_rules, pattern_rules
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
from .tree import (
    ShapeDtype,
    apply_rules,
    flatten_dotted,
    flatten_with_paths,
    tree_shardings,
    unflatten_dotted,
)
from .visualize import Layout, layout

PartitionSpec = P

__version__ = "0.1.0"

__all__ = [
    "ACTION_KINDS",
    "CANONICAL_AXES",
    "SCHEDULE_NAMES",
    "UNCONSTRAINED",
    "UNEVEN_POLICIES",
    "Action",
    "Boundary",
    "Collective",
    "Layout",
    "LogicalRules",
    "Memory",
    "Mesh",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "PatternRules",
    "Plan",
    "Precision",
    "Rule",
    "Schedule",
    "ShapeDtype",
    "Simulation",
    "Stage",
    "apply_rules",
    "backend",
    "bubble_formula",
    "compose",
    "dims",
    "flatten_dotted",
    "flatten_with_paths",
    "gantt",
    "gpipe",
    "interleaved_1f1b",
    "layout",
    "logical_rules",
    "one_f_one_b",
    "pattern_rules",
    "schedule",
    "simulate",
    "tree_shardings",
    "unflatten_dotted",
    "validate_schedule",
    "zb_h1",
    "zbv",
]
