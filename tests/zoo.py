"""The family zoo: every ``*ForCausalLM`` family the installed transformers ships, built tiny from its own config.

:func:`zoo_families` enumerates transformers' causal-LM auto mapping at run
time (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), so a new transformers release is
covered without editing a list. :func:`build_tiny` builds one family from its
own config class with every size knob the config has set small (2 layers,
hidden 32, 4 query heads over 2 K/V heads of 8 dims, 64-token vocabulary, 4
experts of which 2 are active, windows of 5), random weights drawn so that
greedy continuations are not flat noise, fp32, no end-of-text token.

:func:`run_family` runs ``ar``, ``dflash`` and ``ddtree`` on it against its own
greedy ``generate()`` and returns one of:

* ``("lossless", "")``: all three equal ``generate()`` token for token;
* ``("refused", message)``: :class:`~dflash.target.UnsupportedTargetFeature` or
  :class:`~dflash.target.TargetStructureError`, naming what is missing;
* ``("differs", detail)`` or ``("error", detail)``: anything else (a bug).

Families :func:`build_tiny` cannot build are listed in :data:`UNBUILDABLE`
with the reason; the zoo test checks the list (a listed family that builds
after all, or one that fails to build without being listed, fails the test).
"""

from __future__ import annotations

import os
import traceback
from typing import Dict, List, Tuple

import torch

from prompts import FAMILY_PROMPT, greedy as target_greedy

#: The window of a family whose config has one (12 prompt + 12 new tokens cross it).
WINDOW = 5

#: Size knobs set small on every config that has them (a config ignores the rest).
SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
    # other spellings of the same knobs
    n_embd=32, n_layer=2, n_head=4, n_positions=256, n_inner=64, d_model=32, num_layers=2, ffn_hidden_size=64,
    ffn_dim=64, d_ff=64, n_heads=4, n_layers=2, num_heads=4, num_kv_heads=2, multi_query_group_num=2,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_k=2, top_k=2, moe_intermediate_size=32, expert_intermediate_size=32, shared_expert_intermediate_size=32,
    n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
    # windows, sub-dimensions
    global_head_dim=16, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=None,
)

#: Families the zoo cannot build tiny here, with the reason (the zoo test fails for an unbuildable family not listed).
UNBUILDABLE = {
    # encoder-decoder stacks whose ForCausalLM wraps the decoder half only (their tiny generate() indexes past the
    # layer list the shared knobs give them)
    "bart": "encoder-decoder config: the decoder half's generate() fails on the shared knobs",
    "bigbird_pegasus": "encoder-decoder config: the decoder half's generate() fails on the shared knobs",
    "blenderbot": "encoder-decoder config: its size knobs go by other names",
    "blenderbot-small": "encoder-decoder config: the decoder half's generate() fails on the shared knobs",
    "marian": "encoder-decoder config: the decoder half's generate() fails on the shared knobs",
    "mbart": "encoder-decoder config: the decoder half's generate() fails on the shared knobs",
    "mvp": "encoder-decoder config: the decoder half's generate() fails on the shared knobs",
    "pegasus": "encoder-decoder config: the decoder half's generate() fails on the shared knobs",
    "plbart": "encoder-decoder config: its head count is not a knob the zoo sets",
    "prophetnet": "encoder-decoder config: layer counts per half only",
    "whisper": "speech encoder-decoder: its head count is not a knob the zoo sets",
    "xlnet": "permutation LM without a sequence length limit",
    "reformer": "needs is_decoder and its own chunked-attention knobs",
    "xmod": "needs a default language set before generate()",
    "musicgen": "audio composite config (text encoder + decoder + codec)",
    "musicgen_melody": "audio composite config (text encoder + decoder + codec)",
    "moss_transcribe_diarize": "speech composite config",
    "blt": "byte-latent composite (local encoder / global / local decoder) with sizes by other names",
    "emu3": "image-text composite config",
    "got_ocr2": "vision composite config",
    "phi4_multimodal": "vision / audio composite config",
    "gemma3": "vision composite config (its text model is gemma3_text)",
    "gemma3n": "audio / vision composite config",
    "gemma3n_text": "its layer types must match the KV-sharing pattern of the full-size model",
    "gemma4": "vision composite config (its text model is gemma4_text)",
    "gemma4_assistant": "an assistant head over a Gemma 4 target's states, not a standalone decoder",
    "gemma4_unified": "vision composite config",
    "gemma4_unified_assistant": "an assistant head over a Gemma 4 target's states, not a standalone decoder",
    "qwen3_5": "vision composite config (its text model is qwen3_5_text)",
    "qwen3_5_moe": "vision composite config (its text model is qwen3_5_moe_text)",
    "qwen4_exp": "vision composite config",
    "qwen4_exp_text": "its head dims are derived from knobs the zoo does not set",
    "llama4": "vision composite config (its text model is llama4_text)",
    "dots3_note": "vision composite config",
    "dots3_note_text": "requires as many K/V heads as query heads with its other defaults",
    # state-space and recurrent stacks whose configs compute layer_types / block types
    "bamba": "hybrid Mamba config: its Mamba head knobs are not the zoo's",
    "falcon_h1": "hybrid Mamba config: its Mamba head knobs are not the zoo's",
    "granitemoehybrid": "hybrid Mamba config: its Mamba head knobs are not the zoo's",
    "jamba": "hybrid Mamba config: layer types are computed",
    "mamba": "state-space config: layer types are computed",
    "mamba2": "state-space config: its head knobs are not the zoo's",
    "falcon_mamba": "state-space config: layer types are computed",
    "recurrent_gemma": "recurrent config: block types are computed",
    "zamba": "hybrid Mamba config: layer types are computed",
    "zamba2": "hybrid Mamba config: its generate() fails on the tiny build",
    "xlstm": "recurrent config: its cell shapes derive from knobs the zoo does not set",
    "lfm2_moe": "its dense / MoE layer split has no default",
    "kimi_linear": "its linear-attention head knobs are not the zoo's",
    "cohere_compass_text": "its rotary tables are keyed by layer types its default config lacks",
    # sizes by other names
    "dbrx": "attention / FFN sub-configs with their own knobs",
    "falcon": "head_dim is a read-only property",
    "gpt_neo": "attention layer pattern validated against its own defaults",
    "codegen": "rotary dims are a knob of their own (rotary_dim)",
    "gptj": "rotary dims are a knob of their own (rotary_dim)",
    "dory": "its head dims derive from knobs the zoo does not set",
    "zaya": "supports one expert per token only",
    "deepseek_v32": "its indexer and MoE sizes go by other names",
    "deepseek_v4": "its compressed-attention sizes go by other names",
    "glm_moe_dsa": "its indexer and MoE sizes go by other names",
    "hy_v4": "its sizes go by other names",
    "inkling2_text": "its sizes go by other names",
    "inkling2_loop_text": "its sizes go by other names",
    "roc_bert": "its pronunciation / shape embeddings go by other names",
    "fuyu": "image-text composite config",
    # multi-head latent attention (refused by name when it builds): the rope / nope / value head dims of the tiny
    # build disagree in its own forward
    "axk1": "multi-head latent attention: its own generate() fails on the tiny head dims",
    "axk2": "multi-head latent attention: its own generate() fails on the tiny head dims",
    "deepseek_v3": "multi-head latent attention: its own generate() fails on the tiny head dims",
    "glm4_moe_lite": "multi-head latent attention: its own generate() fails on the tiny head dims",
    "longcat_flash": "multi-head latent attention: its own generate() fails on the tiny head dims",
    "youtu": "multi-head latent attention: its own generate() fails on the tiny head dims",
}

#: Most parameters a zoo model may have (a config whose size knobs go by names :data:`SMALL` does not know).
MAX_PARAMS = 5_000_000

PROMPT = FAMILY_PROMPT
NEW_TOKENS = 12


def zoo_families() -> List[Tuple[str, str]]:
    """``(model_type, class name)`` of every family in transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())




def _has(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 -- a per-layer attribute (Gemma 4's head_dim): the config has it
        return True


def tiny_config(model_type: str, **overrides):
    """The family's own config class, every size knob it has set small (``overrides``: knobs set last)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    kw = dict(SMALL)
    try:
        default = config_class()
    except Exception:  # noqa: BLE001 -- a config without usable defaults: built from the small knobs alone
        default = None
    if default is not None:  # only the knobs this config has (another family's key could mean something here)
        kw = {k: v for k, v in kw.items() if k in ("pad_token_id", "bos_token_id", "eos_token_id",
                                                   "tie_word_embeddings") or _has(default, k)}
    if getattr(default, "sliding_window", None) is not None:
        kw["sliding_window"] = WINDOW  # a family with windows: one the probe and the generation cross
    types = getattr(default, "layer_types", None)
    if types and not isinstance(getattr(type(default), "layer_types", None), property):
        distinct = list(dict.fromkeys(types))
        if "full_attention" in distinct:  # last, as families with a final global layer want
            distinct.remove("full_attention")
            distinct.append("full_attention")
        kw["num_hidden_layers"] = max(2, len(distinct))
        kw["layer_types"] = [distinct[i % len(distinct)] for i in range(kw["num_hidden_layers"])]
        if len(distinct) == 1:
            kw["layer_types"] = list(distinct) * kw["num_hidden_layers"]
    kw.update(overrides)
    config = config_class(**kw)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sub_kw = {k: v for k, v in SMALL.items() if _has(sub, k)}
            setattr(config, name, type(sub)(**dict(sub.to_dict(), **sub_kw)))
    return config


def build_tiny(model_type: str, class_name: str, seed: int = 0, **overrides):
    """A tiny random model of ``class_name`` from :func:`tiny_config` (``overrides``: config knobs), fp32, eval,
    no eos."""
    import transformers

    config = tiny_config(model_type, **overrides)
    model_class = getattr(transformers, class_name)
    with torch.device("meta"):  # count first: a config whose size knobs go by other names could be huge
        n = sum(p.numel() for p in model_class(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n:,} parameters with every known size knob set small (its own knobs go by other names)")
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if p.abs().mean() > 0.5 else p.normal_(0.0, 0.1)
            elif p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and getattr(head, "weight", None) is not None:
            head.weight.mul_(4.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.float().eval()


def greedy(model, n: int = NEW_TOKENS, prompt=PROMPT) -> torch.Tensor:
    """A family model's own greedy text: :func:`prompts.greedy` of the family prompt, under inference mode."""
    return target_greedy(model, n, prompt, inference_mode=True)


def run_family(model, n: int = NEW_TOKENS, methods=("ar", "dflash", "ddtree")) -> Tuple[str, str]:
    """Run every method against ``model``'s own greedy ``generate()``; see the module docstring for the result."""
    import dflash
    from dflash.target import TargetStructureError
    from tiny_models import RiggedDraft, tiny_draft

    from dflash.target import TargetAdapter

    ref = greedy(model, n)
    try:
        TargetAdapter(model).close()  # a refusal first: the drafter below needs a decoder's config
        layers = getattr(model.config.get_text_config(), "num_hidden_layers", 2)
        draft = tiny_draft(model, block_size=4, target_layer_ids=[0, layers - 1]) if "dflash" in methods or \
            "ddtree" in methods else None
        for method in methods:
            d = None if method == "ar" else RiggedDraft(draft, model.get_output_embeddings().weight, ref,
                                                        p_right=0.7, second_right=method == "ddtree")
            kw = dict(tree_budget=16) if method == "ddtree" else {}
            out = dflash.generate(model, d, PROMPT, method=method, max_new_tokens=n, **kw)
            if not torch.equal(out.output_ids, ref):
                got, want = out.output_ids[0, len(PROMPT):].tolist(), ref[0, len(PROMPT):].tolist()
                first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                return "differs", f"{method}: first different new token at {first}: {got} vs {want}"
    except TargetStructureError as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 -- any other error is a finding
        return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    return "lossless", ""


def build_or_reason(model_type: str, class_name: str):
    """``(model, None)``, or ``(None, reason)`` when the zoo cannot build the family tiny or its own greedy
    ``generate()`` does not run on the tiny build (the reason the zoo test lists)."""
    try:
        model = build_tiny(model_type, class_name)
    except Exception as exc:  # noqa: BLE001 -- the reason is what the test lists
        return None, f"its config does not build tiny: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    try:
        greedy(model, 2)
    except Exception as exc:  # noqa: BLE001
        return None, (f"its own generate() fails on the tiny build: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:160]}")
    return model, None


def short_reason(message: str) -> str:
    """A refusal's feature and detail, without the model class and the boilerplate."""
    for marker in ("unsupported feature: ", "cannot be used as a target: "):
        if marker in message:
            message = message.split(marker, 1)[1]
            break
    return message.split(". A target must expose")[0].split(". The family does something")[0]


FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "zoo_status.json")
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def zoo_status() -> dict:
    """Every family's ending on the reference ops: ``{model_type: [status, reason]}``."""
    families = {}
    for model_type, class_name in zoo_families():
        model, reason = build_or_reason(model_type, class_name)
        if model is None:
            families[model_type] = ["not built tiny", UNBUILDABLE.get(model_type, reason)]
            continue
        status, detail = run_family(model)
        families[model_type] = [status, short_reason(detail)]
    return families


def readme_table(fixture: dict) -> str:
    """The README's supported-targets table from the fixture."""
    rows = ["| model_type | status | why |", "|---|---|---|"]
    for model_type, (status, why) in sorted(fixture["families"].items()):
        rows.append(f"| `{model_type}` | {status} | {why.replace('|', '/')} |")
    counts = {}
    for status, _ in fixture["families"].values():
        counts[status] = counts.get(status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return (f"transformers {fixture['transformers']}: {len(fixture['families'])} causal-LM families: {summary}.\n\n"
            + "\n".join(rows))


def _main(argv) -> None:
    import json
    import sys
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    if "--write" in argv:
        torch.set_num_threads(1)
        data = {"transformers": transformers.__version__, "families": zoo_status()}
        with open(FIXTURE, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
    if "--readme" in argv:
        with open(FIXTURE) as f:
            data = json.load(f)
        text = open(README).read()
        start, end = "<!-- zoo table start -->", "<!-- zoo table end -->"
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1]
        with open(README, "w") as f:
            f.write(head + start + "\n" + readme_table(data) + "\n" + end + tail)
    if not ("--write" in argv or "--readme" in argv):
        sys.exit("usage: python tests/zoo.py [--write] [--readme]")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _main(sys.argv[1:])
