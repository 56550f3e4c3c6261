"""Reference outputs of z-lab's ``dflash`` 0.1.0 for tests/generation/test_zlab_parity.py (tests/fixtures/zlab_dflash2/).

Runs in an environment with z-lab's package and NOT this one (both import as
``dflash``)::

    python3 -m venv /tmp/venv-zlab
    /tmp/venv-zlab/bin/pip install torch==2.13.0            # the CPU wheel
    /tmp/venv-zlab/bin/pip install 'dflash[local]==0.1.0'    # z-lab's package, transformers 5.15
    cd /tmp && PYTHONPATH= /tmp/venv-zlab/bin/python /path/to/repo/bench/zlab_reference.py /path/to/repo/tests/fixtures/zlab_dflash2

It builds, seeded, a tiny Qwen3 target (transformers' own class, byte vocabulary
of 258 ids: 0..255 bytes, 256 mask, 257 eos, as the package's byte tokenizer),
and two drafters of z-lab's own classes: a ``DFlash2DraftModel`` (grouped
dynamic convolutions off the identity, a candidate selector with random
codebooks large enough to re-rank the top-k) and a ``DFlashDraftModel``, both
with z-lab's drafter scalars set away from 1 (``input_embedding_scale``,
``output_multiplier``, for DFlash2 ``final_logit_softcapping``). The drafters'
layers are fitted for 500 steps to the target's greedy continuations
of random prompts (cross-entropy through z-lab's ``compute_logits``), so that
rounds accept more than one token and the selector's choices decide
acceptance; the selector's own weights stay random. Everything is saved with
``save_pretrained``, the DFlash2 codebooks renamed as published checkpoints
name them (z-lab's loader maps the bare names), reloaded with z-lab's
``from_pretrained``, and z-lab's ``dflash_generate`` runs greedily on a few
prompts: with a stop token (every round a full block) and with a length limit
only (the last rounds may verify a shorter block). ``reference.json`` holds the
output ids, per-round acceptance lengths and verified block sizes, and how many
drafted positions the selector moved off the drafter's argmax.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB, MASK, EOS = 258, 256, 257
HIDDEN, TARGET_LAYERS, BLOCK = 64, 4, 6
LAYER_IDS = [1, 2]  # not the last layer: z-lab reads hidden_states[k + 1], which is post-norm for the last one
PROMPTS = ["def f(x):", "hello world", "import os\n", "The quick brown"]
DFLASH2_KEYS = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)
SCALARS = {"dflash2": dict(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=15.0),
           "dflash": dict(input_embedding_scale=2.0, output_multiplier=0.5)}


def zlab():
    import dflash

    if not hasattr(dflash, "DFlash2DraftModel") or "site-packages" not in (dflash.__file__ or ""):
        sys.exit(f"this script needs z-lab's dflash 0.1.0 installed, not {dflash.__file__}: run it outside the "
                 f"repository with an empty PYTHONPATH")
    from dflash import model

    # dflash_generate times its stages with torch.cuda.synchronize(), which a CPU build refuses
    torch.cuda.synchronize = lambda *a, **k: None
    return model


def make_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=0)
    target = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif "lm_head" in name:
                p.normal_(0.0, 2.0 / HIDDEN ** 0.5)  # logits of a few units: greedy choices well apart
            else:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    return target.eval()


def make_drafter(model, kind: str, seed: int):
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    inner = {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, **(DFLASH2_KEYS if kind == "dflash2" else {})}
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, num_target_layers=TARGET_LAYERS, block_size=BLOCK,
                         dflash_config=inner, **SCALARS[kind])
    cls = model.DFlash2DraftModel if kind == "dflash2" else model.DFlashDraftModel
    config.architectures = [cls.__name__]
    draft = cls(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("base_kernel"):  # [2, K, H]: identity plus random taps
                p.zero_()
                p[:, 0] = 1.0
                p.add_(0.2 * torch.randn_like(p))
            elif "kernel_projection" in name:
                p.normal_(0.0, 0.05)
            elif "codebook" in name:
                p.normal_(0.0, 0.3)
            elif "hidden_projection" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return draft


def training_data(target, n=160, prompt_len=8, new=64, seed=5):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(32, 127, (n, prompt_len), generator=g)
    with torch.no_grad():
        seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                               do_sample=False)
        hs = target(seqs, output_hidden_states=True).hidden_states
    return seqs, torch.cat([hs[i + 1] for i in LAYER_IDS], dim=-1)


def fit(model, draft, target, seqs, feats, steps=300, seed=7):
    """Cross-entropy of the drafter's logits (z-lab's compute_logits) against the target's next tokens."""
    g = torch.Generator().manual_seed(seed)
    scale = float(model._draft_value(draft.config, "input_embedding_scale", 1.0))
    params = [p for n, p in draft.named_parameters() if "candidate_selector" not in n]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    W = target.get_input_embeddings().weight.detach()
    draft.train()
    T = seqs.shape[1]
    for step in range(steps):
        a = int(torch.randint(8, T - BLOCK, (1,), generator=g))
        block = torch.cat([seqs[:, a:a + 1], torch.full((seqs.shape[0], BLOCK - 1), MASK)], dim=1)
        pos = torch.arange(a + BLOCK)[None].expand(seqs.shape[0], -1)
        hidden = draft(position_ids=pos, noise_embedding=F.embedding(block, W) * scale,
                       target_hidden=feats[:, :a].detach())
        logits = draft.compute_logits(hidden[:, 1:], target.lm_head)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, a + 1:a + BLOCK].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    return float(loss.detach())


def save(draft, directory: Path, kind: str):
    from safetensors.torch import load_file, save_file

    draft.save_pretrained(directory)
    if kind == "dflash2":  # published checkpoints name the codebooks without ".weight"
        path = directory / "model.safetensors"
        state = load_file(path)
        state = {k[: -len(".weight")] if "codebook" in k else k: v for k, v in state.items()}
        save_file(state, path, metadata={"format": "pt"})


def count_selector_moves(draft):
    """Wrap the selector so each greedy chain counts the positions it moved off the drafter's argmax."""
    tally = {"moved": 0, "positions": 0}
    select = draft.candidate_selector.select

    def counting(hidden, logits, anchor_ids, temperature):
        out = select(hidden, logits, anchor_ids, temperature)
        tally["moved"] += int((out[0] != logits.argmax(-1)).sum())
        tally["positions"] += out[0].numel()
        return out

    draft.candidate_selector.select = counting
    return tally


def pick_stop(target, prompts, new=64, lo=8, hi=40):
    """A stop token that each prompt's greedy continuation first emits between positions lo and hi (so
    every round before it verifies a full block); the one that covers most prompts."""
    best = None
    conts = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            conts.append(target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                         do_sample=False)[0, len(ids):].tolist())
    for t in range(VOCAB):
        if t == MASK:
            continue
        firsts = [c.index(t) if t in c else None for c in conts]
        cover = sum(f is not None and lo <= f <= hi for f in firsts)
        bad = sum(f is not None and f < lo for f in firsts)
        key = (cover - bad, -t)
        if best is None or key > best[0]:
            best = (key, t)
    return best[1]


def verify_sizes(prompt_len, max_new, lengths):
    """The block z-lab verified each round: min(B, max_length - start)."""
    start, out = prompt_len, []
    for n in lengths:
        out.append(min(BLOCK, prompt_len + max_new - start))
        start += n
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the fixture directory (tests/fixtures/zlab_dflash2)")
    p.add_argument("--steps", type=int, default=500, help="drafter fitting steps")
    args = p.parse_args(argv)
    model = zlab()
    import transformers
    from transformers import Qwen3ForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    target = make_target()
    target.save_pretrained(out / "target")
    (out / "target" / "tokenizer_config.json").write_text(
        json.dumps({"type": "byte", "vocab_size": VOCAB, "mask_token_id": MASK, "eos_token_id": EOS}))
    target = Qwen3ForCausalLM.from_pretrained(out / "target").eval()
    seqs, feats = training_data(target)
    prompts = [list(s.encode()) for s in PROMPTS]
    stop = pick_stop(target, prompts)
    record = {"zlab_dflash": "0.1.0", "torch": torch.__version__, "transformers": transformers.__version__,
              "block_size": BLOCK, "stop_token_id": stop, "prompts": prompts, "drafters": {}}
    for kind, seed in (("dflash2", 11), ("dflash", 12)):
        draft = make_drafter(model, kind, seed)
        loss = fit(model, draft, target, seqs, feats, steps=args.steps)
        save(draft, out / kind, kind)
        cls = model.DFlash2DraftModel if kind == "dflash2" else model.DFlashDraftModel
        draft = cls.from_pretrained(out / kind, dtype=torch.float32).eval()
        tally = count_selector_moves(draft) if kind == "dflash2" else None
        runs = []
        for ids in prompts:
            for scenario, max_new, stops in (("stop", 64, [stop]), ("length", 40, None)):
                res = model.dflash_generate(draft, target, torch.tensor([ids]), max_new, stops, temperature=0.0,
                                            return_stats=True)
                lengths = [int(n) for n in res.acceptance_lengths]
                runs.append(dict(prompt=ids, scenario=scenario, max_new_tokens=max_new, stop_token_ids=stops,
                                 output_ids=res.output_ids[0].tolist(), acceptance_lengths=lengths,
                                 verify_sizes=verify_sizes(len(ids), max_new, lengths)))
        record["drafters"][kind] = dict(fit_loss=loss, runs=runs, selector=tally)
        print(kind, "fit loss", round(loss, 3), "tau",
              [round(sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"]), 2) for r in runs],
              "selector moves", tally)
    (out / "reference.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
