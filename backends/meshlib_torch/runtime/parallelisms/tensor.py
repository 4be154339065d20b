"""Tensor (and sequence) parallelism on a real mesh: the compiled collectives bound to process groups.

The compiler placed every value and inserted each redistribution as a
`CommSpec` and each rank-dependent op (the vocab-parallel embedding and loss)
as a `SpecialSpec`; lowering left a stand-in (`Pending`) for each in the
modules this rank runs. Here each becomes the module that runs it on this
rank's coordinates and its axes' process groups: a `Comm` (one c10d collective
per axis that changes, counted) or the local op.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ...compiler.placement.placements import Pending
from ...compiler.placement.redistribute import CommSpec
from ...modules.special import special_module
from ...spmd.eager import EagerBackend
from .. import dist as mdist
from ..comm import Comm, reducer


def apply_tensor(par) -> dict[str, nn.Module]:
    """The tensor-parallel step: every stand-in in this rank's modules replaced by its collective or
    rank-dependent op, bound to this rank's coordinates and process groups. Returns them by name."""
    compiled = par.compiled
    groups = {a: mdist.group(par.device_mesh, a) for a in compiled.mesh.axis_names}
    coords = compiled.mesh.coords(dist.get_rank())
    backend = EagerBackend(compiled.mesh, par.device_mesh)  # the regions' collectives, counted as Comm's are

    def bind(spec) -> nn.Module:
        if isinstance(spec, CommSpec):
            return Comm(spec, compiled.axes, groups, coords, mode=compiled.options.recompute)
        return special_module(spec, coords, reducer(groups), backend)

    bound: dict[str, nn.Module] = {}
    for module in par.stage_modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Pending):
                    setattr(parent, name, bound.setdefault(child.spec.name, bind(child.spec)))
    return bound


__all__ = ["apply_tensor"]
