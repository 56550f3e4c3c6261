"""Write the speculators drafter fixtures under ``tests/fixtures/speculators/`` with speculators' own classes.

Runs ONLY in a virtual environment that has ``speculators==0.9.0`` installed
(it is not a dependency of this package)::

    python3 -m venv /work/venv-spec
    /work/venv-spec/bin/pip install torch==2.13.0 && /work/venv-spec/bin/pip install speculators==0.9.0
    /work/venv-spec/bin/pip uninstall -y torchvision torchaudio
    OMP_NUM_THREADS=1 /work/venv-spec/bin/python bench/make_speculators_fixtures.py

(speculators' torchvision / torchaudio requirements move torch to 2.14.1; the
committed fixtures were made with that build, on the CPU.)

For each of ``dflash`` and ``dflash2`` it builds speculators' drafter
(``DFlashDraftModel`` / ``DFlash2DraftModel``, hidden 32, 2 layers, vocab 300,
block 4, ``aux_hidden_state_layer_ids`` [2, 4], eager attention), and as
``<kind>_sliding`` the same with layers [sliding_attention (window 2),
full_attention] at speculators' default ``sliding_window_non_causal`` (false for
dflash, true for dflash2), fills every
weight with seeded random values (the convolutions too, which speculators
initialises to the identity), saves it with its own ``save_pretrained`` into
``<name>/``, and runs its training forward (``_backbone_forward``) on fixed
inputs with every valid anchor selected (deterministic). ``<name>_expected.safetensors``
(beside the checkpoint: a loader reads every weight file inside it) holds what a
loader must reproduce:

* ``features [T, 2*32]`` context features, ``input_ids [T]``, ``anchors [A]``,
* ``block_embeds [A*4, 32]``: the verifier's embedding of each block (its anchor's
  token, then the mask token), ``lm_head [300, 32]``: the verifier's head (neither
  is part of the checkpoint),
* ``hidden [A*4, 32]``: the final-normed block states, ``logits [A*4, 300]``,
* DFlash2: ``predecessors [A*4]``, ``candidates [A*4, k]`` and ``scores [A*4, k]``
  of the candidate selector for the teacher-forced predecessors.

Then, for each ``ours_<kind>/`` present (drafters written by this package's
speculators writer, first made in the package's own environment with
``python -c "import sys; sys.path[:0] = ['.', 'tests']; import test_checkpoint_formats as t; t.write_ours_fixtures()"``),
it loads the directory with speculators' own ``from_pretrained``, runs the same
forward and writes ``ours_<kind>_expected.safetensors`` (same keys as above,
without the selector's).
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the verifier named in the config is not fetched

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

H, V, B, T = 32, 300, 4, 12
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "speculators")


def layer_config(sliding: bool) -> Qwen3Config:
    window = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=2,
                  use_sliding_window=True) if sliding else {}
    cfg = Qwen3Config(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=V, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      tie_word_embeddings=False, **window)
    cfg._attn_implementation = "eager"
    return cfg


def build(kind: str, sliding: bool = False):
    common = dict(
        transformer_layer_config=layer_config(sliding), draft_vocab_size=V, block_size=B,
        aux_hidden_state_layer_ids=[2, 4], mask_token_id=V - 1,
        speculators_config=SpeculatorsConfig(
            algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="tiny-verifier", architectures=["Qwen3ForCausalLM"])))
    if kind == "dflash":
        return DFlashDraftModel(DFlashSpeculatorConfig(**common))
    return DFlash2DraftModel(DFlash2SpeculatorConfig(**common, conv_kernel_size=2, conv_group_size=8,
                                                     selector_rank=8, selector_top_k=5))


def fixed_inputs(hidden: int):
    """``(features [1, T, 2*hidden], input_ids [1, T], loss_mask [1, T])``: every valid anchor (3, 5, 7) is
    taken with ``max_anchors=3``."""
    features = torch.randn(1, T, 2 * hidden)
    input_ids = torch.randint(0, V - 1, (1, T))
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, [3, 5, 7]] = 1
    return features, input_ids, loss_mask


def block_embeds(model, input_ids) -> torch.Tensor:
    """``[A*B, H]``: the verifier's embedding of each anchor block as speculators builds it (the anchor's token,
    then ``mask_token_id``)."""
    ids = torch.full((3, B), model.config.mask_token_id)
    ids[:, 0] = input_ids[0, [3, 5, 7]]
    with torch.no_grad():
        return model.embed_tokens(ids.reshape(-1)).clone()


def backbone(model, features, input_ids, loss_mask):
    hidden_size = model.config.transformer_layer_config.hidden_size
    with torch.no_grad():
        return model._backbone_forward(features, input_ids, loss_mask, torch.randn(1, T, hidden_size),
                                       torch.zeros(1, T, dtype=torch.long), max_anchors=3)


def check_ours(kind: str) -> None:
    """speculators' ``from_pretrained`` on ``ours_<kind>/`` and its forward on fixed inputs."""
    directory = os.path.join(OUT, f"ours_{kind}")
    cls = DFlash2DraftModel if kind == "dflash2" else DFlashDraftModel
    config = cls.config_class.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    model = cls.from_pretrained(directory, config=config).eval()
    torch.manual_seed(2)
    with torch.no_grad():  # the verifier's embedding and head, not part of the checkpoint
        model.embed_tokens.weight.normal_(0.0, 0.1)
        model.lm_head.weight.normal_(0.0, 0.1)
    features, input_ids, loss_mask = fixed_inputs(model.config.transformer_layer_config.hidden_size)
    hidden, logits, *_ = backbone(model, features, input_ids, loss_mask)
    expected = {"features": features[0], "input_ids": input_ids[0], "anchors": torch.tensor([3, 5, 7]),
                "block_embeds": block_embeds(model, input_ids), "lm_head": model.lm_head.weight.detach().clone(),
                "hidden": hidden[0], "logits": logits[0]}
    save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(OUT, f"ours_{kind}_expected.safetensors"))
    print(f"ours_{kind}: loaded by speculators' {cls.__name__}.from_pretrained")


def main() -> int:
    for name in ("dflash", "dflash2", "dflash_sliding", "dflash2_sliding"):
        kind, sliding = name.split("_")[0], name.endswith("_sliding")
        torch.manual_seed(("dflash", "dflash2", "dflash_sliding", "dflash2_sliding").index(name))
        model = build(kind, sliding).eval()
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    p.uniform_(0.8, 1.2)
                elif "base_kernel" in param_name:
                    p.normal_(0.0, 0.5)
                else:
                    p.normal_(0.0, 0.1)
        directory = os.path.join(OUT, name)
        os.makedirs(directory, exist_ok=True)
        model.save_pretrained(directory)
        os.remove(os.path.join(directory, "config.py"))  # speculators' own config class, named by auto_map
        features, input_ids, loss_mask = fixed_inputs(H)
        hidden, logits, _, _, blocks = backbone(model, features, input_ids, loss_mask)
        expected = {"features": features[0], "input_ids": input_ids[0], "anchors": torch.tensor([3, 5, 7]),
                    "block_embeds": block_embeds(model, input_ids),
                    "lm_head": model.lm_head.weight.detach().clone(),
                    "hidden": hidden[0], "logits": logits[0]}
        if kind == "dflash2":
            predecessors = model._predecessor_ids(input_ids, blocks)
            with torch.no_grad():
                candidates, scores = model.candidate_selector.select(logits, hidden, predecessors.reshape(1, -1))
            expected.update(predecessors=predecessors.reshape(-1), candidates=candidates[0], scores=scores[0])
        save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(OUT, f"{name}_expected.safetensors"))
        print(name, sorted(os.listdir(directory)))
    for kind in ("dflash", "dflash2"):
        if os.path.isdir(os.path.join(OUT, f"ours_{kind}")):
            check_ours(kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
