"""The one patch registry (dflash/target/patches.py) and its four users.

The registry alone, on plain objects: the first holder applies, later ones
count, the last release restores; a failure part-way through ``hold`` gives
back what it took; holders that disagree are refused; shadowing patches put
an instance's own attribute back or remove theirs. Then its users on tiny
models: nested and overlapping adapters on one model (attention, experts and
linear-attention forward at once: a hybrid MoE target loaded with eager
experts), an adapter whose construction fails part-way, an exception inside
a ``with`` block, the drop-in's ``generate``, and that nothing stays
patched after the last close.
"""

from unittest import mock

import pytest
import torch

import dflash
from dflash.target import TargetAdapter, patches
from dflash.target.attention import ATTENTION_NAME
from dflash.target.families import FAMILIES, GENERIC, PATCHES
from dflash.target.patches import Patch, PatchConflict, hold

from tiny_models import tiny_draft, tiny_family_target, tiny_hybrid_target

PROMPT = [3, 7, 11, 5, 9]


class Box:
    """A plain object with a class attribute and a method (what shadowing patches stand in front of)."""

    level = "class"

    def run(self):
        return "class run"


class Prop:
    """An attribute behind a property with a setter, as transformers' config implementations are."""

    def __init__(self):
        self._value = "loaded"
        self.writes = []

    @property
    def impl(self):
        return self._value

    @impl.setter
    def impl(self, value):
        self.writes.append(value)
        self._value = value


def _wrapping(obj, previous):
    return lambda: f"wrapped {previous()}"


# ------------------------------------------------------------------------------------------- the registry alone


def test_first_applies_later_count_last_restores():
    obj = Prop()
    a = hold([Patch(obj, "impl", "ours")])
    b = hold([Patch(obj, "impl", "ours")])
    assert obj.impl == "ours" and obj.writes == ["ours"]  # the second holder wrote nothing
    assert patches.original(obj, "impl") == "loaded" and patches.is_patched(obj, "impl")
    a.release()
    assert obj.impl == "ours" and patches.patched(obj) == [("Prop", "impl", 1)]
    b.release()
    assert obj.impl == "loaded" and obj.writes == ["ours", "loaded"]
    assert patches.patched(obj) == [] and not patches.is_patched(obj, "impl")
    assert patches.original(obj, "impl") == "loaded"


def test_overlapping_holders_in_any_order():
    obj = Box()
    first = hold([Patch(obj, "level", "one")])
    second = hold([Patch(obj, "level", "one")])
    first.release()
    first.release()  # a second release of one holder must not take the other's count
    assert obj.level == "one"
    second.release()
    assert obj.level == "class" and "level" not in obj.__dict__


def test_shadowing_patch_removes_its_entry_or_puts_the_instances_back():
    bare, own = Box(), Box()
    mine = lambda: "own run"  # noqa: E731
    own.__dict__["run"] = mine
    with hold([Patch(bare, "run", wrap=_wrapping, shadow=True), Patch(own, "run", wrap=_wrapping, shadow=True)]):
        assert bare.run() == "wrapped class run" and own.run() == "wrapped own run"
        with hold([Patch(bare, "run", wrap=_wrapping, shadow=True)]):  # same wrap: agrees, counts
            assert bare.run() == "wrapped class run"
        assert "run" in bare.__dict__
    assert "run" not in bare.__dict__ and bare.run() == "class run"
    assert own.__dict__["run"] is mine


def test_a_failure_part_way_gives_back_what_was_taken():
    a, b, c = Box(), Box(), Prop()

    def broken(obj, previous):
        raise RuntimeError("cannot build this one")

    with pytest.raises(RuntimeError, match="cannot build"):
        hold([Patch(a, "level", "x"), Patch(c, "impl", "x"), Patch(b, "run", wrap=broken, shadow=True)])
    assert a.level == "class" and "level" not in a.__dict__ and c.impl == "loaded"
    assert "run" not in b.__dict__ and patches.patched(a) == patches.patched(b) == patches.patched(c) == []
    # a holder already open keeps its patch when a later hold of the same attribute fails
    kept = hold([Patch(a, "level", "x")])
    with pytest.raises(RuntimeError):
        hold([Patch(a, "level", "x"), Patch(b, "run", wrap=broken, shadow=True)])
    assert a.level == "x" and patches.patched(a) == [("Box", "level", 1)]
    kept.release()
    assert a.level == "class"


def test_disagreeing_holders_are_refused_and_leave_nothing():
    obj, other = Box(), Box()
    held = hold([Patch(obj, "level", "one")])
    with pytest.raises(PatchConflict, match="already set to 'one'"):
        hold([Patch(other, "level", "two"), Patch(obj, "level", "two")])
    assert other.level == "class" and obj.level == "one"
    with pytest.raises(PatchConflict):
        hold([Patch(obj, "level", wrap=_wrapping)])
    held.release()
    assert obj.level == "class" and patches.patched(obj) == patches.patched(other) == []


def test_every_restore_runs_even_when_one_fails():
    class Stubborn:
        def __init__(self):
            self.__dict__["value"] = 0
            self.block = False

        def __setattr__(self, name, value):
            if name == "value" and self.block:
                raise RuntimeError("read-only now")
            object.__setattr__(self, name, value)

    stubborn, box = Stubborn(), Box()
    held = hold([Patch(box, "level", "x"), Patch(stubborn, "value", 1)])
    stubborn.block = True
    with pytest.raises(RuntimeError, match="read-only"):
        held.release()
    assert box.level == "class" and patches.patched(box) == patches.patched(stubborn) == []


def test_every_family_names_known_patches():
    for family in list(FAMILIES.values()) + [GENERIC]:
        assert family.patches[0] == "attention" and set(family.patches) <= set(PATCHES), family.name
        assert ("experts" in family.patches) == (family.moe or not family.known), family.name
        assert ("linear_forward" in family.patches) == bool(family.linear_attention), family.name


# ------------------------------------------------------------------------------------------------ the adapter


@pytest.fixture
def hybrid_moe():
    """A target that needs all three adapter patches: Qwen3.5-MoE loaded with eager experts."""
    return tiny_hybrid_target("qwen3_5_moe", experts="eager")


def _state(model):
    """What the adapter may change, as it is now: attention and experts implementations, the linear modules'
    instance forwards."""
    linear = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    return (model.config._attn_implementation, model.config._experts_implementation,
            [m.__dict__.get("forward") for m in linear])


def _objects(model):
    return [model, model.config] + list(model.modules())


def _nothing_patched(model) -> bool:
    return all(patches.patched(o) == [] for o in _objects(model))


def _open_state(model):
    attn, experts, forwards = _state(model)
    return attn == ATTENTION_NAME and experts == "grouped_mm" and all(f is not None for f in forwards)


def test_the_adapter_holds_what_its_family_row_names(hybrid_moe):
    before = _state(hybrid_moe)
    assert before[:2] == ("sdpa", "eager") and before[2] == [None, None]
    with TargetAdapter(hybrid_moe, [0]) as adapter:
        assert adapter.spec.family.patches == ("attention", "experts", "linear_forward")
        assert {p.attr for p in adapter.patches()} == {"_attn_implementation", "_experts_implementation", "forward"}
        assert _open_state(hybrid_moe)
    assert _state(hybrid_moe) == before and _nothing_patched(hybrid_moe)


def test_nested_adapters_restore_on_the_last_close(hybrid_moe):
    before = _state(hybrid_moe)
    outer = TargetAdapter(hybrid_moe, [0])
    opened = _state(hybrid_moe)
    with TargetAdapter(hybrid_moe, [1]) as inner:
        assert inner.spec.experts == "grouped_mm"  # chosen from the loaded implementation, not outer's switch
        assert _state(hybrid_moe) == opened  # the inner one applied nothing new: same dispatchers
    assert _state(hybrid_moe) == opened and _open_state(hybrid_moe)
    outer.close()
    assert _state(hybrid_moe) == before and _nothing_patched(hybrid_moe)
    outer.close()  # closing twice does nothing
    assert _state(hybrid_moe) == before


def test_two_overlapping_adapters_on_one_model(hybrid_moe):
    before = _state(hybrid_moe)
    a = TargetAdapter(hybrid_moe, [0])
    b = TargetAdapter(hybrid_moe, [1])
    a.close()  # the first opened closes first: b still runs on its patches
    assert _open_state(hybrid_moe)
    with torch.inference_mode():
        cache = b.new_cache(16)
        b.prefill(torch.tensor(PROMPT), cache)
    b.close()
    assert _state(hybrid_moe) == before and _nothing_patched(hybrid_moe)


def test_an_exception_in_a_with_block_restores(hybrid_moe):
    before = _state(hybrid_moe)
    with pytest.raises(ZeroDivisionError):
        with TargetAdapter(hybrid_moe, [0]):
            assert _open_state(hybrid_moe)
            1 / 0
    assert _state(hybrid_moe) == before and _nothing_patched(hybrid_moe)


def test_a_construction_failing_part_way_leaves_the_model_as_it_was(hybrid_moe):
    before = _state(hybrid_moe)

    def broken_linear(modules):
        def refuse(obj, previous):
            raise RuntimeError("linear forward cannot be installed")

        return [Patch(modules[0], "forward", wrap=refuse, shadow=True)]

    with mock.patch("dflash.target.adapter.linear_patches", broken_linear):
        with pytest.raises(RuntimeError, match="cannot be installed"):
            TargetAdapter(hybrid_moe, [0])
    assert _state(hybrid_moe) == before and _nothing_patched(hybrid_moe)
    # the adapter captures by returning the layers' outputs from its pass: it never adds hooks
    with TargetAdapter(hybrid_moe, [0, 1]):
        assert not any(layer._forward_hooks for layer in hybrid_moe.model.layers)


def test_an_outer_adapter_survives_an_inner_failure(hybrid_moe):
    with TargetAdapter(hybrid_moe, [0]):
        opened = _state(hybrid_moe)
        with mock.patch("dflash.target.adapter.experts_patches",
                        lambda configs, implementation: [Patch(configs[0], "_experts_implementation", "batched_mm")]):
            with pytest.raises(PatchConflict, match="grouped_mm"):
                TargetAdapter(hybrid_moe, [1])
        assert _state(hybrid_moe) == opened
    assert _nothing_patched(hybrid_moe)


# ------------------------------------------------------------------------------------------------ the drop-in


def test_dropin_generate_is_a_held_patch_restored_by_unapply():
    target = tiny_family_target("qwen3", vocab=64, layers=2)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    before = target.generate
    handle = dflash.apply(target, draft)
    assert patches.is_patched(target, "generate") and target.generate != before
    dflash.apply(target, draft, method="dflash")  # again: replaces the settings, one patch held
    assert patches.patched(target) == [("Qwen3ForCausalLM", "generate", 1), ("Qwen3ForCausalLM", "_dflash_dropin", 1)]
    with TargetAdapter(target, [0]):  # an adapter on the same model holds its own patches beside it
        out = target.generate(torch.tensor([PROMPT]), max_new_tokens=4)
    assert out.shape == (1, len(PROMPT) + 4)
    dflash.unapply(target)
    assert "generate" not in target.__dict__ and target.generate.__func__ is type(target).generate
    assert _nothing_patched(target) and handle.held.released
    with dflash.apply(target, draft):
        assert patches.is_patched(target, "generate")
    assert "generate" not in target.__dict__ and _nothing_patched(target)
