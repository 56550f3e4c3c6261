"""Targets as users hold them: a peft PeftModel (LoRA, DoRA), a quantized model (torchao, bitsandbytes), a
compiled one. Each is lossless against its own greedy ``generate()`` (ar, dflash, ddtree, as
tests/families/test_families.py holds the families), through ``dflash.generate``, ``dflash.apply`` and
``assistant_model=``, or refused by name where it cannot be.

peft, torchao and bitsandbytes are optional: their tests skip, saying so, when the library is absent (or, for
bitsandbytes, does not run on this machine). Tiny fp32 models on the reference ops, few tokens.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import dflash
import dflash_kernels
from dflash import TargetAdapter
from dflash.decoding.parity import first_divergence
from dflash.target import UnsupportedTargetFeature, decoder_parts
from dflash.target.head import TargetHead, head_is_dense
from dflash.target.quantized import row_dependence
from dropin_runs import spy
from tiny_models import tiny_dflash2_draft, tiny_draft, tiny_target

ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 60, 7]])
NEW = 12
METHODS = [("ar", {}), ("dflash", {}), ("ddtree", {"tree_budget": 8})]
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]


def need(module: str):
    """``module`` imported, or the test skipped saying that the optional library is absent."""
    name = module.split(".")[0]
    return pytest.importorskip(module, reason=f"{name} is not installed (optional: pip install "
                                              "dflash-kernels[user-targets])")


@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


def pair(layers=4, hidden=64, dtype=torch.float32, seed=0):
    target = tiny_target("qwen3", layers=layers, hidden=hidden, dtype=dtype, seed=seed)
    return target, tiny_draft(target, block_size=4, target_layer_ids=[1, 2], dtype=dtype)


def own_greedy(model, n=NEW):
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=n, do_sample=False)


def assert_lossless(target, draft, ref, head_path=None, methods=METHODS, spread=0.0):
    """ar, dflash and ddtree give ``ref`` (the target's own greedy output); with ``spread`` a first divergence is
    allowed only where the target's own logits of the two tokens are within ``spread`` (see
    :func:`own_spread`)."""
    for method, extra in methods:
        result = dflash.generate(target, None if method == "ar" else draft, PROMPT, method=method,
                                 max_new_tokens=ref.shape[1] - PROMPT.shape[1], **extra)
        if head_path is not None:
            assert result.head_path == head_path, (method, result.head_path)
        if not torch.equal(result.output_ids, ref):
            div = first_divergence(target, ref[0], result.output_ids[0])
            assert spread and abs(div.logit_margin) <= spread, f"{method}: {div.describe()} (allowed {spread})"



# ------------------------------------------------------------------ PEFT

def peft_target(use_dora=False, modules=LORA_MODULES, seed=0):
    """A PeftModel over a tiny Qwen3 with adapters on attention, MLP, embedding and lm_head, and non-zero adapter
    weights (LoRA's B starts at zero: an untouched adapter changes nothing and no test of it could fail)."""
    peft = need("peft")
    target, draft = pair(seed=seed)
    model = peft.get_peft_model(target, peft.LoraConfig(r=4, lora_alpha=8, use_dora=use_dora,
                                                        target_modules=list(modules)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval(), draft


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_peft_target_is_lossless(use_dora):
    model, draft = peft_target(use_dora)
    ref = own_greedy(model)
    with model.disable_adapter():
        assert not torch.equal(own_greedy(model), ref)  # the adapters matter
    assert TargetAdapter(model).head.path == "module"  # lm_head under an adapter: its own forward
    assert_lossless(model, draft, ref, head_path="module")


def test_peft_disable_adapter_is_honoured():
    model, draft = peft_target()
    with model.disable_adapter():
        base = own_greedy(model)
        assert_lossless(model, draft, base, methods=METHODS[1:])
    assert_lossless(model, draft, own_greedy(model), methods=METHODS[2:])


def test_peft_dropin_assistant_and_stream(monkeypatch):
    model, draft = peft_target()
    ref = own_greedy(model)
    calls = spy(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to transformers
        with dflash.apply(model, draft, method="ddtree", tree_budget=8):
            assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW), ref)
            assert torch.equal(model.generate(input_ids=PROMPT, max_new_tokens=NEW, do_sample=False), ref)
        assert "generate" not in vars(model)  # unapply gave peft's own back
        with dflash.apply(model):
            assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW, assistant_model=draft), ref)
    assert calls == ["ddtree", "ddtree", "dflash"]
    streamed = [t for chunk in dflash.stream(model, draft, PROMPT, max_new_tokens=NEW) for t in chunk]
    assert streamed == ref[0, PROMPT.shape[1]:].tolist()


def test_peft_hybrid_target_is_lossless():
    """A Qwen3.5-shaped hybrid under LoRA: the Gated-DeltaNet verify calls the projections as modules (adapters
    run); an adapter on its depthwise conv, whose weight the verify reads, is refused by name."""
    peft = need("peft")
    from tiny_models import tiny_hybrid_target

    target = tiny_hybrid_target()
    draft = tiny_draft(target, block_size=4, target_layer_ids=[1, 2])
    model = peft.get_peft_model(target, peft.LoraConfig(r=2, target_modules=["in_proj_qkv", "in_proj_z", "out_proj",
                                                                                "q_proj", "o_proj", "lm_head"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    assert_lossless(model, draft, own_greedy(model.eval(), 8), head_path="module")
    conv = tiny_hybrid_target().model.layers[0].linear_attn.conv1d
    wrapped = peft.get_peft_model(tiny_hybrid_target(), peft.LoraConfig(r=conv.groups, target_modules=["conv1d"]))
    with pytest.raises(UnsupportedTargetFeature, match="linear-attention conv under an adapter"):
        TargetAdapter(wrapped)


def test_module_head_takes_a_drafter_of_another_dtype():
    """A bf16 target under LoRA with an fp32 drafter: the drafter's rows reach the lm_head module in its dtype."""
    peft = need("peft")
    target = tiny_target("qwen3", layers=4, dtype=torch.bfloat16)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[1, 2], dtype=torch.float32)
    model = peft.get_peft_model(target, peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])).eval()
    assert_lossless(model, draft, own_greedy(model, 8), head_path="module", methods=METHODS[1:])


def test_peft_dflash2_drafter_is_lossless():
    model, _ = peft_target()
    draft = tiny_dflash2_draft(model.get_base_model(), block_size=4, target_layer_ids=[1, 2])
    assert_lossless(model, draft, own_greedy(model), methods=METHODS[1:])


@pytest.mark.parametrize("method, extra", [("ar", {}), ("dflash", {}), ("dflash", {"acceptance": "match"}),
                                           ("ddtree", {"tree_budget": 8})])
def test_module_head_samples_what_the_fused_head_samples(method, extra):
    """A LoRA on lm_head only, its B zero: the same logits through the module path as through the fused path, so
    the same seed draws the same tokens (the same Gumbel noise per row and id; the processed distribution; the
    rejection rule)."""
    peft = need("peft")
    target, draft = pair()
    kw = dict(method=method, max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=7,
              **extra)
    fused = dflash.generate(target, None if method == "ar" else draft, PROMPT, **kw)
    model = peft.get_peft_model(target, peft.LoraConfig(r=2, target_modules=["lm_head"])).eval()
    module = dflash.generate(model, None if method == "ar" else draft, PROMPT, **kw)
    assert (fused.head_path, module.head_path) == ("fused", "module")
    assert torch.equal(module.output_ids, fused.output_ids)


def _sequences(vocab=90):
    from dflash.training.data import TrainingSequence

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (24,), generator=g)
    mask = torch.ones(24, dtype=torch.bool)
    mask[:4] = False
    return [TrainingSequence(ids, mask, line=1)]


def test_peft_target_trains_a_drafter():
    """The trainer takes the PeftModel as its target: labels are the adapted target's own argmax, the drafter
    learns, the target's adapters get no gradient and do not move."""
    from dflash.training.train import BlockTrainingConfig, capture_target, step_loss, target_labels

    model, _ = peft_target()
    base = model.get_base_model()
    draft = tiny_draft(base, block_size=4, target_layer_ids=[1, 2]).train()
    adapter = TargetAdapter(model, [1, 2, 3])
    seqs = _sequences()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    cfg = BlockTrainingConfig(4, blocks_per_seq=3, logit_layer=3)
    fc = draft.fc.weight.detach().clone()
    for _ in range(2):
        out = step_loss(draft, adapter, seqs, cfg, torch.Generator().manual_seed(0))
        out.loss.backward()
        assert torch.isfinite(out.loss) and draft.fc.weight.grad.abs().sum() > 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert not torch.equal(draft.fc.weight, fc)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    ids = seqs[0].input_ids
    labels = target_labels(adapter, capture_target(adapter, ids, 2, 3).logit_hidden, torch.arange(ids.numel() - 1))
    with torch.no_grad():
        own = model(input_ids=ids[None]).logits[0, :-1].argmax(-1)
    adapter.close()
    assert torch.equal(labels, own)


@pytest.mark.parametrize("config_name", ["Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"])
def test_torchao_target_trains_a_drafter(config_name):
    """A quantized lm_head in the drafter's loss: weight-only is differentiable in its input; dynamic activation
    quantization rounds the input, so the loss takes its exact logits with the dequantized weight's gradient."""
    from dflash.training.train import BlockTrainingConfig, step_loss

    target, _ = torchao_target(config_name)
    target.requires_grad_(False)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[1, 2]).train()
    with TargetAdapter(target, [1, 2, 3]) as adapter:
        out = step_loss(draft, adapter, _sequences(), BlockTrainingConfig(4, blocks_per_seq=3, logit_layer=3),
                        torch.Generator().manual_seed(0))
        out.loss.backward()
    assert torch.isfinite(out.loss) and draft.fc.weight.grad.abs().sum() > 0


def test_train_cli_takes_a_target_adapter(tmp_path):
    """``python -m dflash train --target DIR --target-adapter ADAPTER_DIR``: one step on a saved LoRA."""
    peft = need("peft")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.training.data import write_jsonl
    from dflash.training.train import main

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=256)).eval()
    base.save_pretrained(tmp_path / "target")
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    lora.save_pretrained(tmp_path / "adapter")
    g = torch.Generator().manual_seed(0)
    data = write_jsonl([{"input_ids": torch.randint(0, 90, (24,), generator=g).tolist(),
                         "loss_mask": [0] * 4 + [1] * 20} for _ in range(2)], tmp_path / "d.jsonl")
    rc = main(["--target", str(tmp_path / "target"), "--target-adapter", str(tmp_path / "adapter"), "--tokenizer",
               "byte", "--data", str(data), "--out", str(tmp_path / "drafter"), "--layers", "1", "--block-size", "4",
               "--target-layer-ids", "1,2", "--batch-size", "2", "--blocks-per-seq", "2", "--steps", "1", "--quiet",
               "--no-tensorboard", "--threads", "1", "--mask-token-id", "95"])
    assert rc == 0 and (tmp_path / "drafter" / "config.json").exists()


def test_peft_prompt_learning_is_refused_by_name():
    peft = need("peft")
    target, _ = pair(layers=3, hidden=32)
    model = peft.get_peft_model(target, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(UnsupportedTargetFeature, match="prompt learning"):
        TargetAdapter(model)


# ------------------------------------------------------------------ torchao

def torchao_target(config_name, dtype=torch.float32, **kw):
    quantization = need("torchao.quantization")
    config = getattr(quantization, config_name, None)
    if config is None:
        pytest.skip(f"this torchao has no {config_name}")
    target, draft = pair(dtype=dtype)
    quantization.quantize_(target, config(**kw))
    return target, draft


@pytest.mark.parametrize("config_name, dtype", [("Int8WeightOnlyConfig", torch.float32),
                                                ("Int8WeightOnlyConfig", torch.bfloat16),
                                                ("Float8WeightOnlyConfig", torch.float32)])
def test_torchao_weight_only_target_is_lossless(config_name, dtype):
    target, draft = torchao_target(config_name, dtype)
    assert not head_is_dense(target.lm_head)  # a quantized tensor subclass: the module path
    assert_lossless(target, draft, own_greedy(target), head_path="module")


def own_spread(model, ids: torch.Tensor, n: int):
    """``(greedy output, spread)``: the largest difference between the logits of the model's own one-row
    ``generate()`` steps and those of its own single forward over the same tokens. A model whose numerics are
    not reproducible across pass shapes beyond this (dynamic activation quantization rounds the last-bit
    differences of attention at another row count to whole quantization steps) breaks near-ties within it either
    way; a verify runs other row counts too."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
        steps = torch.stack(out.logits, 1)[0].float()
        full = model(out.sequences).logits[0, ids.shape[1] - 1 : -1].float()
    return out.sequences, float((steps - full).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_int8_dynamic_per_token_activation_is_lossless(dtype):
    """Int8DynamicActivationInt8WeightConfig() quantizes activations per row (PerRow: one scale per token): every
    linear row is a function of its own input row (below, exactly), so a verify is lossless, up to near-ties
    within the model's own spread across pass shapes."""
    target, draft = torchao_target("Int8DynamicActivationInt8WeightConfig", dtype)
    q_proj = target.model.layers[0].self_attn.q_proj
    assert row_dependence(q_proj) is None
    x = torch.randn(1, 8, 64, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(q_proj(x)[0, 3], q_proj(x[:, 3:4])[0, 0])
    ref, spread = own_spread(target, PROMPT, NEW)
    assert_lossless(target, draft, ref, head_path="module", spread=spread)


def test_torchao_int8_dynamic_per_tensor_activation_is_refused():
    """PerTensor() activation scales span every row of a pass: a verify's rows change each other's quantization
    (shown below on one layer), so the target is refused by name."""
    granularity = need("torchao.quantization.granularity")
    target, draft = torchao_target("Int8DynamicActivationInt8WeightConfig", granularity=granularity.PerTensor())
    q_proj = target.model.layers[0].self_attn.q_proj
    x = torch.randn(1, 2, 64)
    x[0, 1] *= 10
    with torch.no_grad():
        assert not torch.equal(q_proj(x)[0, 0], q_proj(x[:, :1])[0, 0])
    assert "PerTensor" in row_dependence(q_proj)
    with pytest.raises(UnsupportedTargetFeature, match="row-dependent quantization.*PerTensor"):
        dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=4)


def test_row_dependence_rules():
    """The rule on torchao's attributes (any of its quantized tensors: Int8Tensor, Float8Tensor, whose dynamic
    activation quantization does not run on a CPU): weight-only, per-token (PerRow / PerToken / PerGroup) and
    static activation scales keep rows apart; one dynamic scale over the pass (PerTensor), or a granularity we
    cannot vouch for, does not."""
    from types import SimpleNamespace

    def linear_with(**attributes):
        linear = torch.nn.Linear(4, 4, bias=False)
        for name, value in attributes.items():
            setattr(linear.weight, name, value)
        return linear

    granularity = lambda name: type(name, (), {})()  # noqa: E731  (torchao's classes, by name)
    assert row_dependence(linear_with()) is None
    for name in ("PerRow", "PerToken", "PerGroup"):
        assert row_dependence(linear_with(act_quant_kwargs=SimpleNamespace(granularity=granularity(name)))) is None
    static = dict(act_quant_kwargs=SimpleNamespace(granularity=granularity("PerTensor")), act_quant_scale=torch.ones(1))
    assert row_dependence(linear_with(**static)) is None
    for name, span in (("PerTensor", "one scale over every row"), ("PerAxis", "not known to be one per token")):
        reason = row_dependence(linear_with(act_quant_kwargs=SimpleNamespace(granularity=granularity(name))))
        assert name in reason and span in reason


def test_torchao_int4_weight_only_where_it_runs():
    quantization = need("torchao.quantization")
    target, draft = pair(dtype=torch.bfloat16, hidden=128)
    try:
        quantization.quantize_(target, quantization.Int4WeightOnlyConfig(group_size=32))
        ref = own_greedy(target, 4)
    except Exception as exc:  # on a CPU torchao's int4 kernels need a GPU (or the mslk package)
        pytest.skip(f"torchao int4 weight-only does not run on this machine: {type(exc).__name__}: {exc}")
    assert_lossless(target, draft, ref, head_path="module")


# ------------------------------------------------------------------ bitsandbytes

@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    target, _ = pair()
    directory = tmp_path_factory.mktemp("bnb_target")
    target.save_pretrained(directory)
    return directory


def bnb_target(directory, **quantization):
    bnb = need("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        probe = bnb.nn.Linear4bit(64, 64, bias=False)
        probe.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False).to("cpu")
        probe(torch.randn(2, 64))
    except Exception as exc:
        pytest.skip(f"bitsandbytes does not run on this machine: {type(exc).__name__}: {exc}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=BitsAndBytesConfig(**quantization),
                                                     device_map="cpu")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.mark.parametrize("quantization, head_path", [
    (dict(load_in_4bit=True), "fused"),  # transformers keeps the lm_head out of the quantization
    (dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"), "fused"),
    (dict(load_in_8bit=True, llm_int8_threshold=0.0), "fused"),
    (dict(load_in_4bit=True, llm_int8_skip_modules=["none"]), "module"),  # the lm_head a packed Params4bit too
    (dict(load_in_8bit=True, llm_int8_threshold=0.0, llm_int8_skip_modules=["none"]), "module"),
], ids=["4bit-fp4", "4bit-nf4", "8bit-no-outliers", "4bit-head", "8bit-head"])
def test_bitsandbytes_target_is_lossless(saved_target, quantization, head_path):
    target = bnb_target(saved_target, **quantization)
    _, draft = pair()
    assert_lossless(target, draft, own_greedy(target), head_path=head_path)


def test_bitsandbytes_int8_outlier_decomposition_is_refused(saved_target):
    """LLM.int8 with a threshold takes the columns holding an outlier in ANY row out of the int8 product for
    every row: a row's result depends on the others (shown on one layer), so it is refused by name."""
    target = bnb_target(saved_target, load_in_8bit=True)
    q_proj = target.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64)
    x[1, 5] = 40.0
    with torch.no_grad():
        assert not torch.equal(q_proj(x)[0], q_proj(x[:1])[0])
    with pytest.raises(UnsupportedTargetFeature, match="llm_int8_threshold=6.0"):
        TargetAdapter(target)


# ------------------------------------------------------------------ compiled and other wrappers

def test_compiled_model_in_generate_apply_and_assistant(monkeypatch):
    """``torch.compile(model)``: our rounds call the model's layers (not the compiled forward: nothing is
    compiled here); ``apply`` patches the compiled module's own ``generate``, the one its users call."""
    target, draft = pair(layers=3, hidden=32)
    ref = own_greedy(target)
    compiled = torch.compile(target)
    assert decoder_parts(compiled)[0] is target.model
    assert_lossless(compiled, draft, ref, methods=METHODS[1:])
    calls = spy(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dflash.apply(compiled, draft, method="dflash"):
            assert torch.equal(compiled.generate(PROMPT, max_new_tokens=NEW), ref)
        with dflash.apply(compiled):
            assert torch.equal(compiled.generate(PROMPT, max_new_tokens=NEW, assistant_model=draft), ref)
    assert calls == ["dflash", "dflash"]
    assert "generate" not in vars(compiled) and "generate" not in vars(target)


def test_compiled_forward_in_generate_apply_and_assistant(monkeypatch):
    """``model.forward = torch.compile(model.forward)``: the rounds never call it (no compile happens here)."""
    from torch._dynamo.utils import counters

    target, draft = pair(layers=3, hidden=32)
    ref = own_greedy(target)
    target.forward = torch.compile(target.forward)
    graphs = counters["stats"]["unique_graphs"]
    assert_lossless(target, draft, ref, head_path="fused", methods=METHODS[1:])
    calls = spy(monkeypatch)
    with dflash.apply(target, draft, method="ddtree", tree_budget=8):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=NEW), ref)
    with dflash.apply(target):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=NEW, assistant_model=draft), ref)
    assert calls == ["ddtree", "dflash"]
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled: the user's forward is never called
    assert "forward" in vars(target)  # and left as the user set it


def test_data_parallel_wrapper_is_unwrapped():
    target, draft = pair(layers=3, hidden=32)
    ref = own_greedy(target)
    assert_lossless(torch.nn.DataParallel(target), draft, ref, methods=METHODS[1:2])


# ------------------------------------------------------------------ the head decision

def test_head_path_decision():
    target, _ = pair(layers=3, hidden=32)
    assert head_is_dense(target.lm_head) and TargetAdapter(target).head.path == "fused"
    hooked = torch.nn.Linear(32, 96, bias=False)
    hooked.register_forward_hook(lambda m, i, o: o)
    assert not head_is_dense(hooked)
    assert not head_is_dense(torch.nn.Linear(32, 96, bias=True))
    half = torch.nn.Linear(32, 96, bias=False).to(torch.float64)
    assert not head_is_dense(half)
    head = TargetHead.of(target.lm_head.weight)
    assert head.fused and head.vocab_size == 96 and head.hidden_size == 32
    result = dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=2)
    assert result.head_path == "fused"


# ------------------------------------------------------------------ README

def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("### Targets as you hold them")
    return text[start : text.index("\n## ", start)]


def test_readme_targets_as_you_hold_them_runs():
    """The section's Python block runs as written (on the shipped tiny pair)."""
    need("peft")
    need("torchao")
    blocks = re.findall(r"```python\n(.*?)```", readme_section(), flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md: Targets as you hold them", "exec"), {})  # noqa: S102 (our own documentation)


def test_the_optional_libraries_are_never_imported_at_module_level():
    """peft, torchao and bitsandbytes stay optional: no module of ours imports them at its top level (the
    trainer's ``--target-adapter`` imports peft inside the function that needs it)."""
    import ast

    optional = {"peft", "torchao", "bitsandbytes"}
    for path in sorted((ROOT / "dflash").rglob("*.py")) + sorted((ROOT / "dflash_kernels").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not {n.split(".")[0] for n in names} & optional, f"{path.relative_to(ROOT)} imports {names}"
