"""P and Mesh: value semantics, constructors, rank maps and the errors users see."""

import pickle

import pytest

from meshlib import UNCONSTRAINED, Mesh, P


def test_p_is_frozen_hashable_and_reads_like_its_constructor():
    spec = P("dp", None, ("tp", "cp"))
    assert repr(spec) == "P('dp', None, ('tp', 'cp'))"
    assert spec == P("dp", None, ["tp", "cp"]) and hash(spec) == hash(P("dp", None, ("tp", "cp")))
    assert P(("dp",)) == P("dp")  # one-axis tuples normalise, as in JAX
    assert P("dp") != P("dp", None)
    assert repr(P()) == "P()"
    assert repr(P("dp", UNCONSTRAINED)) == "P('dp', UNCONSTRAINED)"
    assert repr(P("dp", unreduced={"tp"})) == "P('dp', unreduced={'tp'})"
    with pytest.raises(AttributeError):
        spec.unreduced = frozenset()
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert pickle.loads(pickle.dumps(P(UNCONSTRAINED)))[0] is UNCONSTRAINED


def test_p_views():
    spec = P(("tp", "dp"), None, "cp", unreduced={"ep"})
    assert spec.sharded_axes == ("tp", "dp", "cp")
    assert spec.axes == ("tp", "dp", "cp", "ep")
    assert spec.dim_axes(0) == ("tp", "dp") and spec.dim_axes(1) == () and spec.dim_axes(7) == ()
    assert spec.padded(5) == P(("tp", "dp"), None, "cp", None, None, unreduced={"ep"})
    assert P.from_json(spec.to_json()) == spec
    assert P.from_json(P(UNCONSTRAINED, None).to_json()) == P(UNCONSTRAINED, None)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: P("dp", "dp"), "uses mesh axis 'dp' twice"),
        (lambda: P(("dp", "tp"), "tp"), "uses mesh axis 'tp' twice"),
        (lambda: P("dp", unreduced={"dp"}), "both sharding a dim and unreduced"),
        (lambda: P(3), "entry 0 is 3"),
        (lambda: P(("dp", 4)), "tuple entry holds mesh axis names"),
    ],
)
def test_p_errors_name_the_values(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_mesh_constructors_agree():
    assert Mesh(dp=2, tp=4) == Mesh((2, 4), ("dp", "tp")) == Mesh({"dp": 2, "tp": 4})
    mesh = Mesh(dp=2, tp=4)
    assert repr(mesh) == "Mesh(dp=2, tp=4)"
    assert mesh.shape == {"dp": 2, "tp": 4} and mesh.size == 8 and mesh.ndim == 2
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert Mesh.from_json(mesh.to_json()) == mesh
    assert Mesh.parse("dp=2, tp=4") == mesh
    assert Mesh(rows=3).axis_names == ("rows",)  # any identifier is an axis name


def test_row_major_coords_round_trip():
    mesh = Mesh(pp=2, dp=3, tp=2)
    for r in range(mesh.size):
        assert mesh.rank(mesh.coords(r)) == r
    assert mesh.coords(7) == {"pp": 1, "dp": 0, "tp": 1}  # 7 = 1*6 + 0*2 + 1


def test_groups_partition_the_ranks():
    mesh = Mesh(dp=2, cp=2, tp=2)
    assert mesh.group(5, "tp") == (4, 5)
    assert mesh.group(5, "dp") == (1, 5)
    assert mesh.group(5, ("dp", "cp")) == (1, 3, 5, 7)
    assert mesh.group(5, ("cp", "dp")) == (1, 5, 3, 7)  # first axis major
    for axes in ("dp", ("dp", "cp"), ("tp", "dp"), ()):
        groups = mesh.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(8))
        for g in groups:
            assert all(mesh.group(r, axes) == g for r in g)
            assert [mesh.axis_coord(r, axes) for r in g] == list(range(len(g)))


def test_flatten_and_submesh():
    mesh = Mesh(pp=2, dp=2, cp=2, tp=2)
    flat = mesh.flatten(("dp", "cp"))
    assert flat == Mesh(pp=2, dp_cp=4, tp=2)
    for r in range(mesh.size):
        assert flat.axis_coord(r, "dp_cp") == mesh.axis_coord(r, ("dp", "cp"))
    assert mesh.submesh(("tp", "dp")) == Mesh(tp=2, dp=2)
    with pytest.raises(ValueError, match="adjacent axes in mesh order"):
        mesh.flatten(("dp", "tp"))


def test_for_world_infers_one_axis():
    assert Mesh.for_world(16, dp=-1, tp=4) == Mesh(dp=4, tp=4)
    with pytest.raises(ValueError, match="world size 6 is not a multiple"):
        Mesh.for_world(6, dp=-1, tp=4)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Mesh(dp=0), "size 0"),
        (lambda: Mesh((2, 2), ("dp", "dp")), "repeat a name"),
        (lambda: Mesh((2,), ("dp", "tp")), "2 axis names"),
        (lambda: Mesh((2,), ("d p",)), "not a Python identifier"),
        (lambda: Mesh((2,), ("dp",), tp=2), "not both"),
        (lambda: Mesh(dp=2).axis_index("tp"), r"unknown mesh axis 'tp'; this mesh has axes \('dp',\)"),
        (lambda: Mesh(dp=2, tp=2).check_world_size(8), "has 4 ranks but the world size is 8"),
        (lambda: Mesh.parse("dp:2"), "not axis=size"),
    ],
)
def test_mesh_errors(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()
