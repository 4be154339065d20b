"""Pipelines of a model that neither torch.fx nor torch.export can trace: stages cut by module FQN.

Method: the test model is the bundled Llama with tied embedding and head, whose
forward branches on its input's data pointer (as launchers of custom kernels
do): fx cannot branch on a traced value and torch.export's fake tensors have
no data, while the meta device runs it (a null pointer). First, `trace` fails
on both paths. Then the parity harness trains it on real gloo ranks with a pp
axis and compares losses, gradient norms and every parameter after 3 AdamW
steps with the single-process run in fp64 (to 1e-12): 1F1B and ZB-H1 at pp=2,
interleaved 1F1B and ZBV with two stages per rank (ZBV puts the first and last
stage, which share the tied embedding, on one rank), and pp=2 x dp=2 with the
tied embedding on the first and last stage. The plan (from `compile_model`, no
processes) records the eager path, both trace failures, the stages and their
boundaries; and a tp axis fails on every rank before any communication.
"""

import re

import pytest
import torch

from meshlib import Mesh
from meshlib_torch import COUNTER, compile_model, parallelize
from meshlib_torch.compiler.capture.call import bind_call
from meshlib_torch.compiler.capture.trace import Untraceable, trace
from meshlib_torch.models import config, default_rules
from meshlib_torch.models.llama import Llama
from meshlib_torch.runtime import dist as mdist
from meshlib_torch.testing.parity import RunConfig, compare, pipeline_sends, train_parallel, train_reference
from meshlib_torch.testing.pool import get_pool

pytestmark = pytest.mark.ranks


class UntraceableLlama(Llama):
    """Llama with a tied head, whose forward branches on a data pointer (16-byte alignment)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, targets):
        if tokens.data_ptr() % 16:  # a custom kernel would want aligned inputs
            tokens = tokens.clone()
        return super().forward(tokens, targets)


def _model(device="meta", **overrides):
    with torch.device(device):
        return UntraceableLlama(config("llama-tiny", **overrides))


def test_the_model_is_untraceable_on_both_paths():
    for device in ("meta", "cpu"):
        x = torch.zeros(2, 16, dtype=torch.long, device=device)
        with pytest.raises(Untraceable) as err:
            model = _model(device)
            trace(model, bind_call(model, (x, x)))
        assert "TraceError" in err.value.fx and "data pointer" in err.value.export
    mesh = Mesh(tp=2)  # without a pipeline there is nothing to fall back to: the error says what to change
    with pytest.raises(ValueError, match=r"cannot be traced\.\n  fx: TraceError.*\n  torch\.export: .*\nFix: make"):
        compile_model(_model(), mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x))


@pytest.mark.parametrize(
    "mesh, sched, layers",
    [
        ("pp=2", "1f1b", 2),
        ("pp=2", "zb-h1", 2),
        ("pp=2", "interleaved-1f1b", 4),
        ("pp=2", "zbv", 4),  # the first and last stage on rank 0 share the tied embedding
        ("pp=2,dp=2", "1f1b", 2),
    ],
)
def test_parity_with_the_single_process_run(mesh, sched, layers):
    run = RunConfig(
        model="llama-tiny", mesh=mesh, microbatches=2, schedule=sched, overrides={"n_layers": layers},
        model_class=UntraceableLlama,
    )  # fmt: skip
    results = get_pool(Mesh.parse(mesh).size).run(train_parallel, run)
    result = results[0]
    diffs = compare(train_reference(run), result, run.tolerance)
    assert diffs["loss"] < 1e-12
    sent, planned = pipeline_sends(results)
    assert planned["forward"] > 0 and sent == planned
    assert result.plan.note_map["stage split"] == "by module FQN on the eager model, balanced by flops"
    if "dp" in mesh:  # the tied embedding lives on both stages; its gradient is summed between them
        assert ("backward", "all_reduce", "pp") in result.comm["by_kind"]
        assert ("backward", "all_reduce", "dp") in result.comm["by_kind"]


def test_plan_records_the_eager_split_both_trace_failures_and_the_boundaries():
    mesh = Mesh(pp=2)
    x = torch.zeros(4, 16, dtype=torch.long, device="meta")
    compiled = compile_model(
        _model(n_layers=4), mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x), microbatches=2
    )
    stages = compiled.stages
    plan = compiled.plan
    notes = plan.note_map
    lines = notes["trace"].splitlines()
    assert lines[0] == "failed" and lines[1].startswith("fx: TraceError")
    assert lines[2].startswith("export: RuntimeError") and "data pointer" in lines[2]
    assert notes["stage split"] == "by module FQN on the eager model, balanced by flops"
    assert [s.modules for s in plan.stages] == [("layers.0", "layers.1"), ("layers.2", "layers.3")]
    assert all(s.cost > 0 for s in plan.stages)
    sends = {b.name: b for b in plan.stages[0].sends}
    assert sends["layers.1"].shape == (2, 16, 32) and sends["layers.1"].dtype == "float32"
    assert sends["layers.1"].bytes == 2 * 16 * 32 * 4
    assert sends["targets"].shape == (2, 16) and sends["targets"].dtype == "int64"
    assert plan.stages[1].sends == ()
    records = [c for c in plan.collectives if c.kind == "send_recv"]
    assert {(c.node, c.phase) for c in records} == {
        ("layers.1", "forward"), ("layers.1", "backward"), ("tokens", "forward"), ("targets", "forward")
    }  # fmt: skip
    assert "tok_embeddings.weight" in stages.params[0] & stages.params[1]  # the tied head on the last stage

    user = compile_model(
        _model(n_layers=4), mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x), microbatches=2,
        split_points=[1],
    ).plan  # fmt: skip
    assert [s.modules for s in user.stages] == [("layers.0",), ("layers.1", "layers.2", "layers.3")]
    assert user.note_map["stage split"] == "by module FQN on the eager model, balanced by user split points"


def _tp_on_untraceable():
    mesh = Mesh(pp=2, tp=2)
    x = torch.zeros(4, 16, dtype=torch.long)
    COUNTER.reset()
    before = len(mdist._MESHES)
    try:
        parallelize(
            _model(), mesh=mesh, rules=default_rules("llama-tiny", mesh), example_inputs=(x, x),
            init=lambda n: ("zeros", 0.0), microbatches=2,
        )  # fmt: skip
    except ValueError as err:
        return str(err), COUNTER.calls, len(mdist._MESHES) - before
    return "no error", 0, 0


def test_tp_with_an_untraceable_model_fails_on_every_rank_before_any_communication():
    both = r"cannot be traced \(fx: TraceError: .*; torch\.export: RuntimeError: .*data pointer"
    for text, calls, meshes in get_pool(4).run(_tp_on_untraceable):
        assert re.search(both, text), text
        assert "also asks for tp=2" in text and "use a mesh with only dp and pp" in text
        assert calls == 0 and meshes == 0


def test_stages_with_only_the_embedding_or_the_head():
    """The split by module FQN with balance="layers" and two stages more than layers: the first stage stops
    after the embedding, the last takes the hidden state into its norm and head."""
    run = RunConfig(model="llama-tiny", mesh="pp=2", microbatches=4, schedule="interleaved-1f1b", chunks=2,
                    balance="layers", overrides={"n_layers": 2}, model_class=UntraceableLlama)  # fmt: skip
    results = get_pool(2).run(train_parallel, run)
    assert compare(train_reference(run), results[0], run.tolerance)["loss"] < 1e-12
    sent, planned = pipeline_sends(results)
    assert planned["forward"] > 0 and sent == planned
    stages = results[0].plan.stages
    assert [s.modules for s in stages] == [(), ("layers.0",), ("layers.1",), ()]
    assert results[0].plan.note_map["stage split"] == "by module FQN on the eager model, balanced by layers"
