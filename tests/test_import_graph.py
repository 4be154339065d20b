"""The packages' import graph: no cycles, no private name across modules, torch's privates in one place.

Method: every module of `meshlib` and `meshlib_torch` is parsed (not imported) and each
`import` / `from ... import` is resolved to the package module it names, lazy imports inside
functions included. The graph must have no cycle; no `from x import _name` may cross a module
line within the packages; and a private name of torch may be imported only by
`meshlib_torch/torch_private.py`, the one module a torch upgrade can break. The layers hold too:
the core imports no torch, and the compiler nothing of the runtime.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"meshlib": ROOT / "meshlib", "meshlib_torch": ROOT / "backends" / "meshlib_torch"}
TORCH_PRIVATE = "meshlib_torch.torch_private"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for pkg, root in PACKAGES.items():
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).with_suffix("")
            parts = [pkg, *(p for p in rel.parts if p != "__init__")]
            out[".".join(parts)] = (f, f.name == "__init__.py")
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """`(imported module, imported name or None, line)` for every import in module `name`."""
    path, is_pkg = MODULES[name]
    here = name if is_pkg else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.append((full, None, node.lineno) if full in MODULES else (target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
    return out


def _edges() -> dict[str, set[str]]:
    return {
        name: {target for target, _, _ in _imports(name) if target in MODULES and target != name} for name in MODULES
    }


def test_there_are_no_import_cycles():
    edges, state, stack, cycles = _edges(), {}, [], []

    def visit(u: str) -> None:
        state[u] = "open"
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == "open":
                cycles.append(" -> ".join(stack[stack.index(v) :] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_no_private_name_crosses_a_module_line():
    found = []
    for name in MODULES:
        for target, imported, line in _imports(name):
            if imported is None or not imported.startswith("_") or imported.startswith("__") or target == name:
                continue
            ours = target.split(".")[0] in PACKAGES
            if ours or name != TORCH_PRIVATE:
                found.append(f"{MODULES[name][0].relative_to(ROOT)}:{line}: from {target} import {imported}")
    assert not found, "private names imported across modules:\n  " + "\n  ".join(found)


@pytest.mark.parametrize(
    "layer, forbidden",
    [("meshlib.", ("torch", "meshlib_torch")), ("meshlib_torch.compiler.", ("meshlib_torch.runtime",))],
)
def test_layers_import_only_downwards(layer, forbidden):
    found = [
        f"{name} imports {target}"
        for name in MODULES
        if name.startswith(layer) or name == layer.rstrip(".")
        for target, _, _ in _imports(name)
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    ]
    assert not found, "\n".join(found)


def test_the_checks_see_what_they_look_for():
    """The parser resolves relative imports: the compiler's orchestrator imports its passes."""
    assert {"meshlib_torch.compiler.graph", "meshlib_torch.compiler.pipeline.compile"} <= _edges()["meshlib_torch.compiler.compile"]
    assert any(imported == "_StridedShard" for _, imported, _ in _imports(TORCH_PRIVATE))


# names with a leading underscore that are public API: namedtuple's methods, os._exit, sys._getframe
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe"}


def _own_private_names() -> set[str]:
    """Every `_name` our packages define: functions, classes, module globals and attributes they assign."""
    out = set()
    for path, _ in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
    return {n for n in out if n.startswith("_")}


def test_torchs_private_attributes_are_read_in_one_module():
    """`x._name` on an object of torch's (a DTensor's `_local_tensor`, a module's `_parameters`, a view's `_base`)
    is read only in torch_private.py; elsewhere only our own private names, and ops in torch's `aten` namespace
    (their names start with an underscore)."""
    own, found = _own_private_names(), []
    for name, (path, _) in MODULES.items():
        if name == TORCH_PRIVATE or not name.startswith("meshlib_torch"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if node.attr in own or node.attr in PUBLIC_UNDERSCORE or ast.unparse(node.value).endswith("aten"):
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not found, "torch's private attributes read outside torch_private.py:\n  " + "\n  ".join(found)
