"""The target-side checks that close the silent-difference class of bug.

* ``final_norm.fusable_norm``: the final norm is fused into the lm_head ops only when the module computes
  exactly their RMSNorm, whatever its class is called;
* ``own_forward_check``: a model whose own forward does something our passes do not reproduce is refused when it
  is first adapted (and only then: the verdict is kept per model);
* decoder layers that drop the attention keywords (StableLM, Nemotron) still get our pass.
"""

import pytest
import torch
from torch import nn

import dflash
from dflash.target import TargetAdapter, UnsupportedTargetFeature
from dflash.target import own_forward_check
from dflash.target.final_norm import fusable_norm
from prompts import FAMILY_PROMPT as PROMPT, greedy
from tiny_models import tiny_family_target, tiny_target


class _LlamaStyle(nn.Module):
    """The fused ops' RMSNorm under a name no table knows."""

    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(h))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class _OnePlusW(_LlamaStyle):
    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class _WeightAfterCast(_LlamaStyle):
    """gpt-oss' order: the weight multiplies in fp32, then the cast."""

    def forward(self, x):
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_ops_rmsnorm_is_fused(dtype):
    torch.manual_seed(0)
    assert fusable_norm(_LlamaStyle(32).to(dtype)) == 1e-5
    assert fusable_norm(_OnePlusW(32).to(dtype)) is None
    assert fusable_norm(nn.LayerNorm(32).to(dtype)) is None
    assert fusable_norm(nn.LayerNorm(32, bias=False).to(dtype)) is None
    if dtype == torch.bfloat16:  # same math in fp32; the cast comes after the weight, so bf16 rounds differently
        assert fusable_norm(_WeightAfterCast(32).to(dtype)) is None


def test_a_renamed_norm_is_fused_and_a_layernorm_runs_as_the_module():
    target = tiny_target("llama", layers=2, hidden=32)
    with TargetAdapter(target) as adapter:
        assert adapter.fuse_norm and adapter.norm_eps == target.model.norm.variance_epsilon
    ln = tiny_target("llama", layers=2, hidden=32, seed=3)
    ln.model.norm = nn.LayerNorm(32)
    with torch.no_grad():
        ln.model.norm.weight.normal_(1.0, 0.2)
        ln.model.norm.bias.normal_(0.0, 0.5)
    ref = greedy(ln, 10, PROMPT, inference_mode=True)
    with TargetAdapter(ln) as adapter:
        assert not adapter.fuse_norm
    out = dflash.generate(ln, None, PROMPT, method="ar", max_new_tokens=10)
    assert torch.equal(out.output_ids, ref)


def _shifted(target, shift=0.5):
    """A model whose own decoder adds ``shift`` to the embeddings: a step our passes do not know."""
    decoder = target.model
    forward = decoder.forward

    def shifted_forward(*args, inputs_embeds=None, input_ids=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = decoder.embed_tokens(input_ids)
        return forward(*args, inputs_embeds=inputs_embeds + shift, **kwargs)

    decoder.forward = shifted_forward
    return target


def test_a_forward_our_passes_do_not_reproduce_is_refused():
    """Without the check this model decodes into another text without a word."""
    target = _shifted(tiny_target("llama", layers=2, hidden=32, seed=5))
    with pytest.raises(UnsupportedTargetFeature, match="a forward that differs from the model's own"):
        dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=4)
    with pytest.raises(UnsupportedTargetFeature, match=r"probe row \d+ of 12 .*first layer whose output differs: 0"):
        TargetAdapter(target)  # kept: raised again, with the same message
    assert target.config._attn_implementation != "dflash"  # the refusal released the adapter's patches


def test_the_verdict_is_kept_per_model_dtype_and_device():
    target = tiny_target("llama", layers=2, hidden=32, seed=7)
    calls = []
    hook = target.register_forward_hook(lambda *a: calls.append(1))
    TargetAdapter(target).close()
    assert len(calls) == 2  # the probe: prefill and the rows on its cache
    TargetAdapter(target).close()
    dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=3)
    assert len(calls) == 2
    target.to(torch.bfloat16)
    TargetAdapter(target).close()
    assert len(calls) == 4  # a new dtype is checked again
    own_forward_check.forget(target)
    TargetAdapter(target).close()
    assert len(calls) == 6
    hook.remove()


@pytest.mark.parametrize("model_type", ["stablelm", "nemotron"])
def test_layers_that_drop_the_attention_keywords_get_our_pass(model_type):
    """StableLM and Nemotron call ``self_attn(...)`` without the layer's kwargs; before the active pass their
    attention fell back to the model's own function with no mask, attending from the top-left corner over the
    cached rows (a different text from the second token on)."""
    from zoo import build_tiny, greedy, run_family, zoo_families

    classes = dict(zoo_families())
    if model_type not in classes:
        pytest.skip(f"{model_type} is not in this transformers")
    model = build_tiny(model_type, classes[model_type])
    assert run_family(model) == ("lossless", "")


def test_the_cost_benchmark_runs(capsys):
    """``python bench/own_forward_check.py`` (the README's cost of the check) at smoke size."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "own_forward_check.py"
    spec = importlib.util.spec_from_file_location("own_forward_check_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--layers", "1", "--hidden", "128", "--max-new-tokens", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2 and "check / generate" in rows[0]  # header, the tiny pair, one Qwen3


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_half_precision_moe_passes_and_a_real_difference_is_still_refused(family):
    """bf16 MoE targets: both sides run the experts implementation the adapter switches to, and up to
    ``MOE_HALF_ROWS`` rows may differ (router near-ties); a structural difference reaches more rows."""
    target = tiny_family_target(family, vocab=64, seed=2).to(torch.bfloat16)
    TargetAdapter(target).close()  # passes
    broken = _shifted(tiny_family_target(family, vocab=64, seed=3).to(torch.bfloat16))
    with pytest.raises(UnsupportedTargetFeature, match="a forward that differs from the model's own"):
        TargetAdapter(broken)
