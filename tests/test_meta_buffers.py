"""Meta buffers filled by the nearest init code that owns them (`runtime.buffers.fill_meta_buffers`), one process.

Method: small plain `nn.Module` trees built on the meta device, whose init code writes known constants
(so which code ran is read off the values): a module's own `init_buffers()` wins over an ancestor's
`init_weights()`; an ancestor's `_init_weights(module)` is called with the module that owns the buffer,
as Hugging Face does; code that leaves a buffer unwritten (in whole or part) passes it on to the next
ancestor; a parameter or buffer with values keeps them bit for bit however the init code re-draws them;
and a buffer that nothing fills raises one error naming it, its owner, what was tried and the fix. The
Hugging Face rotary embedding (transformers 5) is filled by its model's `_init_weights` and equals the
one its constructor computes on the CPU.
"""

from __future__ import annotations

import pytest
import real_models as rm
import torch
from safetensors.torch import save_model
from torch import nn

import meshlib as ml
from meshlib_torch import compile_model, parallelize
from meshlib_torch.runtime.buffers import fill_meta_buffers
from meshlib_torch.runtime.lower import _constants
from meshlib_torch.testing.pool import get_pool
from meshlib_torch.testing.reference import Trial, assert_same, run_parallel, run_single


class Table(nn.Module):
    """A buffer made in `__init__` alone (as rotary tables are), optionally with its own `init_buffers`."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.proj = nn.Linear(n, n)
        self.register_buffer("table", torch.arange(n, dtype=torch.float32), persistent=False)


class OwnInit(Table):
    def init_buffers(self) -> None:
        self.table.fill_(1.0)


class Parent(nn.Module):
    """`init_weights()` re-draws every parameter and writes 2 into every `table` below it."""

    def __init__(self, child: nn.Module):
        super().__init__()
        self.child = child
        self.head = nn.Linear(4, 4)

    def init_weights(self) -> None:
        for mod in self.modules():
            for p in mod.parameters(recurse=False):
                nn.init.normal_(p)
            if hasattr(mod, "table"):
                mod.table.fill_(2.0)


class HFStyle(nn.Module):
    """`_init_weights(module)`, called by Hugging Face for each module: writes 3 into a `table`, noting the module."""

    def __init__(self, child: nn.Module):
        super().__init__()
        self.inner = nn.ModuleDict({"block": child})
        self.seen = []

    def _init_weights(self, module: nn.Module) -> None:
        self.seen.append(module)
        if isinstance(module, Table):
            module.table.fill_(3.0)


def _meta(build):
    with torch.device("meta"):
        return build()


def test_the_owners_init_buffers_wins_over_an_ancestors_init_weights():
    model = _meta(lambda: Parent(OwnInit()))
    fill_meta_buffers(model, ["child.table"])
    assert model.child.table.device.type == "cpu" and torch.equal(model.child.table, torch.ones(4))


def test_the_nearest_ancestors_init_weights_fills_a_buffer_whose_owner_has_none():
    model = _meta(lambda: Parent(Table()))
    fill_meta_buffers(model, ["child.table"])
    assert torch.equal(model.child.table, torch.full((4,), 2.0))


def test_an_ancestors_init_weights_underscore_is_called_with_the_owning_module():
    model = _meta(lambda: Parent(HFStyle(Table())))  # the nearer ancestor, HFStyle, wins over Parent
    fill_meta_buffers(model, ["child.inner.block.table"])
    assert torch.equal(model.child.inner.block.table, torch.full((4,), 3.0))
    assert model.child.seen == [model.child.inner.block]


class HalfFill(Table):
    def init_buffers(self) -> None:  # writes half the table: the rest would be whatever memory held
        self.table[:2] = 5.0


def test_code_that_leaves_a_buffer_partly_unwritten_passes_it_to_the_next_ancestor():
    model = _meta(lambda: Parent(HalfFill()))
    fill_meta_buffers(model, ["child.table"])
    assert torch.equal(model.child.table, torch.full((4,), 2.0))


class IntTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("index", torch.arange(3), persistent=False)
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool), persistent=False)

    def init_buffers(self) -> None:
        self.index[0] = 7  # the other elements are left unwritten
        self.mask.fill_(True)


def test_integer_and_bool_buffers_left_unwritten_are_caught_too():
    model = _meta(IntTable)
    want = (r"  index \(a buffer of IntTable \(the root\), not persistent: no checkpoint saves it\): tried "
            r"IntTable\.init_buffers\(\) \(the root\): none wrote all of it")  # fmt: skip
    with pytest.raises(ValueError, match=want) as err:
        fill_meta_buffers(model, ["index", "mask"])
    assert "mask" not in str(err.value)


def test_parameters_and_buffers_with_values_are_not_re_initialised():
    """The init code re-draws every parameter and writes every table; only the meta buffer changes."""
    torch.manual_seed(0)
    model = Parent(Table())
    model.child.table = torch.empty(4, device="meta")  # the one buffer without values
    model.register_buffer("kept", torch.tensor([9.0, 8.0]))
    sibling = Table()
    model.sib = sibling  # a real buffer of the same class, also written by init_weights
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta}
    objects = {n: t for n, t in model.named_parameters()}
    fill_meta_buffers(model, ["child.table"])
    assert torch.equal(model.child.table, torch.full((4,), 2.0))
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        if name != "child.table":
            assert torch.equal(value, before[name]), name
    assert all(p is objects[n] for n, p in model.named_parameters())  # the same Parameter objects, still trained


def test_the_random_generator_is_left_as_it_was():
    model = _meta(lambda: Parent(Table()))
    torch.manual_seed(5)
    fill_meta_buffers(model, ["child.table"])
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


def test_a_buffer_nothing_fills_raises_naming_it_its_owner_and_the_fix():
    model = _meta(lambda: nn.Sequential(nn.Linear(4, 4), Table()))
    with pytest.raises(ValueError) as err:
        fill_meta_buffers(model, ["1.table"], why="weights= holds none of them")
    msg = str(err.value)
    assert "nothing gives them values (weights= holds none of them)" in msg
    assert "1.table (a buffer of Table at '1', not persistent: no checkpoint saves it): no init code owns it: " in msg
    assert "it: Table.__init__ alone makes its value" in msg
    assert "Fix: give Table an init_buffers(self) that fills its buffers whole, as __init__ computes them" in msg
    assert model[1].table.is_meta  # left as it came


class Raises(Table):
    def init_buffers(self) -> None:
        raise RuntimeError("boom")


def test_init_code_that_raises_is_named():
    model = _meta(lambda: Parent(Raises()))
    with pytest.raises(ValueError, match=r"Raises\.init_buffers\(\) at 'child', run to fill the meta buffers "
                       r"child\.table, raised RuntimeError: boom") as err:  # fmt: skip
        fill_meta_buffers(model, ["child.table"])
    assert isinstance(err.value.__cause__, RuntimeError)
    assert model.child.table.is_meta  # left as it came


class Reshapes(Table):
    def init_buffers(self) -> None:
        self.table = torch.zeros(5)


def test_init_code_that_changes_a_buffers_shape_raises():
    model = _meta(Reshapes)
    with pytest.raises(ValueError, match=r"made the buffer table \(5,\) torch\.float32, but the model has it \(4,\)"):
        fill_meta_buffers(model, ["table"])


def test_hugging_face_rotary_buffers_are_remade_by_the_models_init_weights():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16)  # fmt: skip

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = tf.LlamaForCausalLM(cfg)

    model = _meta(Wrapper)
    fill_meta_buffers(model, ["lm.model.rotary_emb.inv_freq"])
    want = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg).inv_freq  # the constructor's, on the CPU
    torch.testing.assert_close(model.lm.model.rotary_emb.inv_freq, want, rtol=0, atol=0)
    assert all(p.is_meta for p in model.parameters())


# -- the pipeline cut by module name (no tracer can follow the model), on real gloo ranks ---------------
class Shifted(nn.LayerNorm):
    """A final norm with a persistent buffer changed after construction (as running statistics are), which
    the checkpoint holds, and a computed one that its own `init_buffers` alone fills (it resets both)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.register_buffer("shift", torch.zeros(n))
        self.register_buffer("gain", torch.ones(n), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.gain + self.shift

    def init_buffers(self) -> None:
        self.gain.fill_(1.5)
        self.shift.zero_()


def build_shifted() -> nn.Module:
    torch.manual_seed(0)
    model = rm.UntraceableNanoGPT()
    model.ln_f = Shifted(32)
    model.ln_f.shift.normal_()
    model.ln_f.gain.fill_(1.5)
    return model.double()


def meta_shifted() -> nn.Module:
    with torch.device("meta"):
        return build_shifted()


@pytest.mark.ranks
def test_the_eager_pipeline_takes_buffers_from_the_checkpoint_and_the_owners_init(tmp_path):
    """pp=2 of the untraceable nanoGPT-style model from the meta device with `weights=`: `shift` is the
    checkpoint's (not the zeros `init_buffers` writes), `gain` is `init_buffers`'s, nested below a root that
    has no init code; losses, gradients and parameters equal the unmodified model's (fp64, 1e-12)."""
    save_model(build_shifted(), str(tmp_path / "model.safetensors"))
    options = {"weights": str(tmp_path / "model.safetensors"), "microbatches": 2}
    trial = Trial(meta_shifted, rm.nanogpt_batch, mesh="pp=2", rules=rm.rules_nanogpt, loss=1, options=options)
    want = run_single(Trial(build_shifted, rm.nanogpt_batch, loss=1))
    got = get_pool(2).run(run_parallel, trial)[0]
    assert dict(got.plan.notes)["trace"].startswith("failed")  # cut by module name
    assert_same(want, got, rtol=1e-12, atol=1e-12)


# -- constants torch.export lifts out of the forward ----------------------------------------------------
class MadeInForward(nn.Module):
    """A tensor made in the forward from a Python list; fx cannot trace the shape check, torch.export lifts
    the tensor out as a constant of its graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, y):
        assert x.shape[0] > 0
        return ((self.lin(x) * torch.tensor([1.0, 2.0], device=x.device) - y) ** 2).mean()


def build_made_in_forward() -> nn.Module:
    torch.manual_seed(0)
    return MadeInForward()


def made_in_forward_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(4000 + step)
    return torch.randn(8, 2, generator=gen), torch.randn(8, 2, generator=gen)


@pytest.mark.ranks
def test_a_constant_lifted_out_of_the_forward_is_carried_to_the_ranks():
    """dp=2 against the unmodified model (fp32, 1e-6); the lowering once lost the constant (no attribute
    `lifted_tensor_0`)."""
    trial = Trial(build_made_in_forward, made_in_forward_batch, mesh="dp=2")
    got = get_pool(2).run(run_parallel, trial)[0]
    assert dict(got.plan.notes)["trace"] == "export"
    assert_same(run_single(trial), got, rtol=1e-6, atol=1e-6)


def test_a_constant_made_on_the_meta_device_raises_naming_it():
    with torch.device("meta"):
        model = MadeInForward()
    compiled = compile_model(model, mesh=ml.Mesh(dp=2), rules=ml.pattern_rules({}, default=ml.P()),
                             example_inputs=made_in_forward_batch(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"reads constants made on the meta device, whose values are unknown: "
                       r"lifted_tensor_0\. Fix: make them buffers"):  # fmt: skip
        _constants(compiled, set())


# -- a buffer nothing fills, on real gloo ranks -----------------------------------------------------------
class Unfilled(nn.LayerNorm):
    """A final norm with a computed buffer that only its `__init__` makes (`reset_parameters` leaves it)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.register_buffer("gain", torch.linspace(1.0, 2.0, n), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.gain


def build_unfilled() -> nn.Module:
    torch.manual_seed(0)
    model = rm.NanoGPT()
    model.ln_f = Unfilled(32)
    return model


def _unfilled_on_a_rank(path: str) -> tuple[str, int]:
    """The error `parallelize` raises on this rank, and the all-reduces issued before it."""
    with torch.device("meta"):
        model = build_unfilled()
    calls, all_reduce = [], torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: calls.append(1) or all_reduce(*a, **k)
    try:
        parallelize(model, mesh=ml.Mesh(dp=2), rules=rm.rules_nanogpt(ml.Mesh(dp=2)),
                    example_inputs=rm.nanogpt_batch(0), loss=1, weights=path)  # fmt: skip
    except ValueError as err:
        return str(err), len(calls)
    finally:
        torch.distributed.all_reduce = all_reduce
    return "no error", len(calls)


@pytest.mark.ranks
def test_a_buffer_nothing_fills_raises_on_every_rank_before_any_collective(tmp_path):
    save_model(build_unfilled(), str(tmp_path / "model.safetensors"))
    results = get_pool(2).run(_unfilled_on_a_rank, str(tmp_path / "model.safetensors"))
    assert len(set(results)) == 1, results
    text, calls = results[0]
    assert calls == 0
    assert text == (
        "the model's buffers are on the meta device and nothing gives them values (weights= does not hold them):\n"
        "  ln_f.gain (a buffer of Unfilled at 'ln_f', not persistent: no checkpoint saves it): tried "
        "Unfilled.reset_parameters() at 'ln_f': none wrote all of it\n"
        "Fix: give Unfilled an init_buffers(self) that fills its buffers whole, as __init__ computes them, or build "
        "the model with real buffers and only its parameters on the meta device"
    )
