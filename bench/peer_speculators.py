"""The tiny target's drafter trained by vLLM's ``speculators`` (0.9.0) and by ``python -m dflash train``, same data.

``speculators``' own pipeline does not run on a CPU: its data step asks a vLLM server for the target's
hidden states (``speculators.data_generation.vllm_client``), and its trainer moves the model to
``self.local_rank`` (``model.to(0)``, a CUDA device index: "Found no NVIDIA driver" here). Its DFlash
model and loss do run on a CPU (``draft_attn_impl="eager"``, the eager loss), so ``train`` below drives
them with a plain loop that mirrors ours: hidden states of the target's layers 1 and 3 and its last
layer computed here once per sequence (as ``--cache-target`` does for ours), 8 sequences per step, at
most 32 anchors per sequence, AdamW (0.9, 0.95), weight decay 0.01, gradient clip 1, 50 warm-up steps
then a cosine over the wall-clock budget, decay gamma 4 for B=8. Its drafter has our drafter's
parameter names, so ``eval`` loads it into ours and measures tau on the held-out prompts, beside our
drafter and an untrained one::

    SPECULATORS_VENV/bin/python bench/peer_speculators.py train --data DATA.jsonl --out SPEC_DIR --minutes 8
    python -m dflash train --target dflash/assets/tiny/target --data DATA.jsonl --out OURS_DIR --layers 2 \\
        --block-size 8 --target-layer-ids 1,3 --minutes 8 --batch-size 8 --blocks-per-seq 32 --cache-target \\
        --save-dtype fp32 --threads 1
    python bench/peer_speculators.py eval --ours OURS_DIR --peer SPEC_DIR --out RESULT.json

(``train`` runs in a venv with ``speculators==0.9.0``, the other two in this package's.)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "dflash" / "assets" / "tiny" / "target"


def _lr(progress: float, step: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(args) -> int:
    from safetensors.torch import save_file
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    layer_cfg = copy.deepcopy(AutoConfig.from_pretrained(str(TARGET)))
    layer_cfg.num_hidden_layers = 2
    draft = DFlashDraftModel.from_training_args(layer_cfg, draft_vocab_size=layer_cfg.vocab_size, block_size=8,
                                                verifier_name_or_path=str(TARGET), target_layer_ids=[1, 3],
                                                mask_token_id=256, draft_attn_impl="eager").float().train()
    loss_config = resolve_loss_config("ce", "eager")
    records = [json.loads(line) for line in open(args.data) if line.strip()]
    captured = {}
    hooks = [target.model.layers[k].register_forward_hook(
        lambda mod, inp, out, k=k: captured.__setitem__(k, out[0] if isinstance(out, tuple) else out))
        for k in sorted({1, 3, target.config.num_hidden_layers - 1})]
    cache = {}

    def features(i):
        if i not in cache:
            ids = torch.tensor([records[i]["input_ids"]])
            with torch.no_grad():
                target(input_ids=ids)
            last = target.config.num_hidden_layers - 1
            cache[i] = (ids, torch.tensor([records[i]["loss_mask"]], dtype=torch.float32),
                        torch.cat([captured[1], captured[3]], dim=-1).detach(), captured[last].detach())
        return cache[i]

    params = [p for n, p in draft.named_parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.01), dict(params=other, weight_decay=0.0)],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    start, step, history = time.perf_counter(), 0, []
    while (time.perf_counter() - start) < args.minutes * 60:
        progress = (time.perf_counter() - start) / (args.minutes * 60)
        for g in opt.param_groups:
            g["lr"] = _lr(progress, step, args.lr, 50)
        batch = torch.randint(0, len(records), (args.batch_size,), generator=gen).tolist()
        total, accs = 0.0, []
        for i in batch:
            ids, mask, hs, last = features(i)
            _, loss, metrics = draft(hidden_states=hs, input_ids=ids, loss_mask=mask, verifier_last_hidden_states=last,
                                     document_ids=torch.zeros_like(ids), loss_config=loss_config, gamma=4.0,
                                     max_anchors=args.max_anchors)
            total = total + loss / len(batch)
            accs.append(float(metrics["full_acc_sum"] / metrics["full_acc_total"]))
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0:
            history.append(dict(step=step, minutes=round((time.perf_counter() - start) / 60, 2),
                                loss=round(float(total), 4), acc=round(sum(accs) / len(accs), 3)))
            print(json.dumps(history[-1]), flush=True)
    for h in hooks:
        h.remove()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = {n: p.detach().contiguous() for n, p in draft.named_parameters()
            if n.split(".")[0] in ("layers", "norm", "fc", "hidden_norm")}
    save_file(keep, str(out / "drafter_weights.safetensors"))
    (out / "train_log.json").write_text(json.dumps(dict(steps=step, minutes=args.minutes, history=history,
                                                        sequences=len(records), cached=len(cache)), indent=2))
    return 0


def evaluate(args) -> int:
    from safetensors.torch import load_file

    import dflash_kernels
    from dflash import DFlashDraftModel
    from dflash.tiny.corpus import heldout_prompts
    from dflash.tiny.models import load_tiny_target
    from dflash.training.evaluation import measure_tau

    torch.set_num_threads(args.threads)
    target = load_tiny_target()
    ours = DFlashDraftModel.from_pretrained(args.ours, dtype=torch.float32)
    peer = DFlashDraftModel(ours.config).float()
    missing, unexpected = peer.load_state_dict(load_file(str(Path(args.peer) / "drafter_weights.safetensors")),
                                               strict=False)
    assert not [m for m in missing if "rotary" not in m] and not unexpected, (missing, unexpected)
    torch.manual_seed(0)
    untrained = DFlashDraftModel(ours.config).float()
    prompts = heldout_prompts(args.prompts, 128, seed=0)
    result = {"prompts": len(prompts), "prompt_tokens": 128, "new_tokens": args.new_tokens,
              "set": "held-out stdlib packages (json, email, asyncio, xml), heldout_prompts(seed=0)"}
    with dflash_kernels.force_backend("reference"):
        for name, draft in (("dflash-kernels", ours), ("speculators-0.9.0", peer), ("untrained", untrained)):
            row = {}
            for temperature in (0.0, 0.7):
                m = measure_tau(target, draft, prompts, max_new_tokens=args.new_tokens, temperature=temperature)
                row[f"tau_T{temperature}"] = round(m["tau"], 3)
            result[name] = row
            print(name, row, flush=True)
    for name, d in (("dflash-kernels", args.ours), ("speculators-0.9.0", args.peer)):
        result[name]["steps"] = json.loads((Path(d) / "train_log.json").read_text())["steps"]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--minutes", type=float, default=5.0)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--max-anchors", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    e = sub.add_parser("eval")
    e.add_argument("--ours", required=True)
    e.add_argument("--peer", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--prompts", type=int, default=16)
    e.add_argument("--new-tokens", type=int, default=128)
    e.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    return train(args) if args.cmd == "train" else evaluate(args)


if __name__ == "__main__":
    raise SystemExit(main())
