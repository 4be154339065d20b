"""Layout pictures on 1-, 2- and 3-D meshes, for 1-, 2- and 3-D tensors, in text, rich and HTML."""

from rich.console import Console

from meshlib import Mesh, NamedSharding, P, layout


def _rows(view):
    return [line.split() for line in str(view).splitlines()[1:]]


def test_1d_mesh_1d_tensor():
    view = layout(Mesh(tp=4), P("tp"), (8,))
    assert _rows(view)[1] == ["0", "1", "2", "3"]


def test_2d_mesh_replicas_share_a_cell():
    view = layout(Mesh(dp=2, tp=2), P(None, "tp"), (4, 4))
    rows = _rows(view)
    assert rows[0] == ["dim", "1", "[0:2]", "dim", "1", "[2:4]"]
    assert rows[1] == ["dim", "0", "[0:4]", "0,2", "1,3"]


def test_3d_mesh_3d_tensor_one_panel_per_leading_block():
    mesh = Mesh(pp=2, dp=2, tp=2)
    view = layout(mesh, P("pp", ("dp", "tp"), None), (2, 8, 3))
    text = str(view)
    assert "-- dim 0 [0:1]" in text and "-- dim 0 [1:2]" in text
    panels = [p for p, *_ in view.panels()]
    assert len(panels) == 2
    # every rank appears exactly once (nothing replicated: pp x dp x tp all split dims)
    cells = [c for _, _, _, rows in view.panels() for row in rows for c in row]
    assert sorted(r for c in cells for r in c) == list(range(8))
    # the cell of block (dim0 1, dim1 [6:8]) is rank pp=1, dp=1, tp=1
    _, _, _, rows = list(view.panels())[1]
    assert rows[3][0] == [mesh.rank(pp=1, dp=1, tp=1)]


def test_4d_tensor_and_chunk_empty_blocks_are_called_out():
    view = layout(NamedSharding(Mesh(tp=4), P(None, None, "tp"), uneven="chunk"), (2, 2, 3, 5))
    assert "rank 3 holds an empty block" in str(view)
    assert len(list(view.panels())) == 1
    # two different empty blocks are two cells, not replicas of one
    small = layout(Mesh(tp=4), P("tp"), (2,), uneven="chunk")
    assert _rows(small)[1] == ["0", "1", "2", "3"]
    assert "ranks 2,3 hold empty blocks" in str(small)


def test_rich_and_html_render():
    view = layout(Mesh(dp=2, tp=2, cp=2), P(("dp", "cp"), "tp"), (8, 4))
    console = Console(record=True, width=120)
    console.print(view)
    out = console.export_text()
    assert "dim 0 [6:8]" in out and "3" in out
    html = view._repr_html_()
    assert html.count("<td") == 8 and "background" in html
