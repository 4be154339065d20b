"""The core stays torch-free; JAX conversions round-trip; the jax extra fails clearly when absent."""

import subprocess
import sys
import textwrap

import jax
import pytest

from meshlib import Mesh, NamedSharding, P
from meshlib.interop import jax as mj

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {names!r}:
            raise ImportError(f'{{name}} is blocked for this test')
sys.meta_path.insert(0, Block())
"""


def _run(code: str, blocked=("torch",)) -> subprocess.CompletedProcess:
    src = textwrap.dedent(BLOCK.format(names=set(blocked))) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)


def test_core_never_imports_torch():
    proc = _run(
        """
        import meshlib, meshlib.rules, meshlib.tree, meshlib.plan, meshlib.visualize, meshlib.interop.jax
        from meshlib import *
        m = Mesh(dp=2, tp=2)
        print(layout(m, P('dp', 'tp'), (4, 4)))
        print(Plan(m, specs={'w': P('tp')}))
        assert 'torch' not in sys.modules, sorted(k for k in sys.modules if 'torch' in k)
        print('OK')
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK")


def test_jax_interop_says_how_to_install_when_missing():
    proc = _run("import meshlib.interop.jax", blocked=("jax",))
    assert proc.returncode != 0
    assert "meshlib.interop.jax needs jax" in proc.stderr and "pip install 'meshlib[jax]'" in proc.stderr


def test_round_trips():
    mesh = Mesh(dp=2, tp=4)
    jmesh = mj.to_jax_mesh(mesh)
    assert mj.from_jax_mesh(jmesh) == mesh
    assert mj.from_jax_mesh(mj.to_jax_abstract_mesh(mesh)) == mesh
    for spec in (P(), P("dp", None), P(("tp", "dp")), P(None, P.UNCONSTRAINED), P("dp", unreduced={"tp"})):
        assert mj.from_jax_spec(mj.to_jax_spec(spec)) == spec
    s = NamedSharding(mesh, P("tp", "dp"))
    js = mj.to_jax_sharding(s)
    assert isinstance(js, jax.sharding.NamedSharding)
    assert mj.from_jax_sharding(js) == s
    with pytest.raises(ValueError, match="needs 32 devices but jax has 16"):
        mj.to_jax_mesh(Mesh(dp=32))
    with pytest.raises(ValueError, match="uneven='chunk'"):
        mj.to_jax_sharding(NamedSharding(mesh, P("dp"), uneven="chunk"))


def test_backend_lookup_errors_are_clear():
    import meshlib

    with pytest.raises(LookupError, match="no meshlib backend named 'tpu'"):
        meshlib.backend("tpu")


@pytest.mark.parametrize("package", ["meshlib", "meshlib_torch"])
def test_public_names_resolve_and_are_sorted(package):
    """Every name in `__all__` exists, and the list is sorted so a re-export is listed once."""
    import importlib

    mod = importlib.import_module(package)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{package}.__all__ names missing attributes: {missing}"
    assert len(set(mod.__all__)) == len(mod.__all__)
    assert list(mod.__all__) == sorted(mod.__all__)
