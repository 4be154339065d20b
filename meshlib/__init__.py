"""meshlib: declare how every tensor is laid out over a named device mesh.

The core is pure Python (optree and einops); it never imports torch. The
torch backend, `meshlib_torch`, compiles and runs what the core declares.
"""

from ._backend import backend
from .mesh import CANONICAL_AXES, Mesh
from .plan import Boundary, Collective, Memory, Plan, Precision, Stage
from .rules import LogicalRules, PatternRules, Rule, compose, dims, logical_rules, pattern_rules
from .sharding import UNEVEN_POLICIES, NamedSharding
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
    "CANONICAL_AXES",
    "UNCONSTRAINED",
    "UNEVEN_POLICIES",
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
    "ShapeDtype",
    "Stage",
    "apply_rules",
    "backend",
    "compose",
    "dims",
    "flatten_dotted",
    "flatten_with_paths",
    "layout",
    "logical_rules",
    "pattern_rules",
    "tree_shardings",
    "unflatten_dotted",
]
