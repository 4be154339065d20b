"""Finding a backend by name, through the `meshlib.backends` entry point group."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType

_INSTALL = {"torch": "pip install torch==2.13.0 && pip install 'meshlib[torch]'"}


def backend(name: str = "torch", /) -> ModuleType:
    """Import the backend registered as `name` (e.g. `"torch"` -> `meshlib_torch`)."""
    found = {ep.name: ep for ep in entry_points(group="meshlib.backends")}
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise LookupError(f"no meshlib backend named {name!r} is installed (installed: {known})")
    target = found[name].value
    try:
        return importlib.import_module(target)
    except ImportError as err:
        fix = _INSTALL.get(name, f"install the package that provides {target}")
        raise ImportError(f"meshlib backend {name!r} ({target}) cannot be imported: {err}. Fix: {fix}") from err
