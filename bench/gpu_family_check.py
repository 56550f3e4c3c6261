"""Our passes vs the model's own forward on gpt-oss-20b-, Gemma3- and Gemma2-shaped layer stacks (random bf16 weights).

Run on a GPU machine: ``python bench/gpu_family_check.py``; on a CPU (a test of the script):
``python bench/gpu_family_check.py --device cpu --tiny``, or ``--dry-run`` (the same, naming what
it leaves out: ``set_sync_debug_mode`` needs CUDA).

Stacks (transformers' own classes, cut to a few decoder layers, the real widths):

* ``gpt-oss-20b``: hidden 2880, 64/8 heads x 64, attention sinks, alternating 128-token
  windows (sliding, full), 32 experts top-4 with biases (MoE), yarn rope; 2 layers;
* ``gemma3-12b``: hidden 3840, 16/8 heads x 256, ``query_pre_attn_scalar`` 256, 5:1
  local/global (1024-token windows), rope per layer type (local theta 1e4, global 1e6 with
  linear x8), scaled embeddings, (1 + w) norms; 6 layers;
* ``gemma2-9b``: hidden 3584, 16/8 heads x 256, attention softcap 50, final-logit softcap 30,
  alternating 4096-token windows; 2 layers (Gemma3 has no softcap: this covers it).

For each: the model's own forward on ``prefix + chain + branch`` tokens (its default attention,
or eager where SDPA would drop a feature: Gemma2's attention softcap, which transformers 5.17 loads with SDPA;
its full causal / sliding masks) against our adapter on the same tokens: prefill
of the prefix (longer than the window), one DFlash chain
verify of ``--block`` tokens, one DDTree tree verify whose first branch is the model's
continuation (the other branch is noise). Compared: the logits (final softcap included) and the
captured layer-0 output, by relative Frobenius error ``|ours - own| / |own|``, bound
``--tol`` (bf16 default 3e-2); the argmax agreement is reported. Also the experts
implementation in use and the CUDA syncs inside our forwards (``set_sync_debug_mode("warn")``,
reported, not a failure).

Prints a table; JSON to ``--json`` (or ``$OUT/gpu_family_check.json``), rewritten after each
stack. Exit 1 if any comparison is over the bound.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import add_dry_run, apply_dry_run, default_json, fail_without_cuda, skipped, write_json  # noqa: E402

PROG = "gpu_family_check"
GPT_OSS_20B = dict(
    cls="GptOss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, vocab_size=201088, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, original_max_position_embeddings=4096,
                         beta_fast=32.0, beta_slow=1.0, truncate=False),
    max_position_embeddings=131072, prefix=300)
GEMMA3_12B = dict(
    cls="Gemma3", hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
    head_dim=256, vocab_size=262208, query_pre_attn_scalar=256, sliding_window=1024,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                     "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)},
    max_position_embeddings=131072, prefix=1100)
GEMMA2_9B = dict(
    cls="Gemma2", hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
    head_dim=256, vocab_size=256000, query_pre_attn_scalar=256, sliding_window=4096,
    layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, max_position_embeddings=8192, prefix=300)
STACKS = {"gpt-oss-20b": GPT_OSS_20B, "gemma3-12b": GEMMA3_12B, "gemma2-9b": GEMMA2_9B}

# the same structure at tiny widths (CPU test of the script): windows small, softcaps that matter
TINY = {
    "gpt-oss-20b": dict(GPT_OSS_20B, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=8,
                        rope_parameters=dict(GPT_OSS_20B["rope_parameters"], factor=4.0,
                                             original_max_position_embeddings=64),
                        max_position_embeddings=256, prefix=24),
    "gemma3-12b": dict(GEMMA3_12B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=128, query_pre_attn_scalar=24,
                       sliding_window=8, max_position_embeddings=256, prefix=24),
    "gemma2-9b": dict(GEMMA2_9B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, query_pre_attn_scalar=24,
                      sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                      max_position_embeddings=256, prefix=24),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny widths (a CPU test of the script)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default) or float32 (default with --tiny)")
    p.add_argument("--only", default=None, help="comma-separated stack names")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--tol", type=float, default=None, help="relative error bound (bf16 3e-2, fp32 1e-4)")
    p.add_argument("--json", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, dtype=None)
    args.dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    if args.tol is None:
        args.tol = 3e-2 if args.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return args


def build(shape: dict, dtype, device, seed: int = 0):
    """The stack's model with random weights (sinks, norms and scales of a trained model's order)."""
    import transformers

    shape = dict(shape)
    cls = shape.pop("cls")
    shape.pop("prefix")
    config_cls = getattr(transformers, "Gemma3TextConfig" if cls == "Gemma3" else f"{cls}Config")
    # the reference forward must apply every feature: SDPA has no softcap input (transformers 5.17 loads
    # Gemma2 with SDPA and drops the attention softcap), eager attention applies it
    attn = dict(attn_implementation="eager") if shape.get("attn_logit_softcapping") else {}
    config = config_cls(num_hidden_layers=len(shape["layer_types"]), tie_word_embeddings=False, pad_token_id=0,
                        **attn, **shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, f"{cls}ForCausalLM")(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(1.0, 1.0)
            elif "norm" in name and cls.startswith("Gemma"):
                p.normal_(0.0, 0.1)
            elif any(k in name for k in ("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)  # scores of several units: softcap and sinks matter
    return model.eval()


def rel_err(ours: torch.Tensor, own: torch.Tensor) -> float:
    ours, own = ours.float(), own.float()
    return float((ours - own).norm() / own.norm().clamp_min(1e-30))


def check_stack(name: str, shape: dict, args) -> list:
    """Rows ``(check, rel_err_logits, rel_err_layer0, argmax_agree, ok)`` of one stack."""
    import dflash_kernels
    from dflash.target import TargetAdapter
    from dflash.target.families import experts_modules

    device = torch.device(args.device)
    model = build(shape, args.dtype, device)
    V, P, B = model.config.vocab_size, shape["prefix"], args.block
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (P + B + 3,), generator=g).to(device)  # prefix, chain, root + 2
    noise = torch.randint(1, V, (2,), generator=g).to(device)
    with torch.inference_mode():
        own = model(ids[None], output_hidden_states=True)
        own_logits, own_layer0 = own.logits[0], own.hidden_states[1][0]
        other = torch.cat([ids[: P + B + 1], noise])
        other_logits = model(other[None]).logits[0]
    rows, syncs = [], 0
    with torch.inference_mode(), TargetAdapter(model, [0]) as adapter:
        moe = experts_modules(model)
        experts = moe[0].config._experts_implementation if moe else "-"  # the one running while open
        cache = adapter.new_cache(P + B + 8)

        def run(fn):
            nonlocal syncs
            if device.type == "cuda":
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        out = fn()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs += sum("synchroniz" in str(w.message) for w in caught)
                return out
            return fn()

        def record(check, hidden, want_logits, want_layer0=None, layer0=None):
            logits = adapter.logits(hidden)
            e_logits = rel_err(logits, want_logits)
            e_layer0 = rel_err(layer0, want_layer0) if layer0 is not None else 0.0
            agree = float((logits.argmax(-1) == want_logits.float().argmax(-1)).float().mean())
            rows.append(dict(stack=name, check=check, rel_err_logits=e_logits, rel_err_layer0=e_layer0,
                             argmax_agree=agree, ok=e_logits <= args.tol and e_layer0 <= args.tol))

        last, features = run(lambda: adapter.prefill(ids[:P], cache))
        record(f"prefill {P}", last, own_logits[P - 1 : P], own_layer0[:P], features)
        h = run(lambda: adapter.forward(ids[P : P + B], torch.arange(P, P + B, device=device), cache))
        record(f"chain verify {B}", h, own_logits[P : P + B], own_layer0[P : P + B], adapter.captured_layer(0))
        cache.commit(B)
        # tree: the root, the model's continuation root -> a -> b, and a noise branch root -> x -> y
        start = P + B
        parents = torch.tensor([-1, 0, 1, 0, 3], device=device)
        depths = torch.tensor([0, 1, 2, 1, 2], device=device)
        tokens = torch.cat([ids[start : start + 3], noise])
        bits = dflash_kernels.ancestor_bits(parents)
        h = run(lambda: adapter.forward(tokens, start + depths, cache, tree_bits=bits))
        record("tree verify 5 (model branch)", h[:3], own_logits[start : start + 3], own_layer0[start : start + 3],
               adapter.captured_layer(0)[:3])
        record("tree verify 5 (noise branch)", h[[0, 3, 4]], other_logits[start:])
    for r in rows:
        r["experts"] = experts
        r["cuda_syncs_in_forwards"] = syncs
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(HERE, ".."))
    import dflash_kernels

    stacks = TINY if args.tiny else STACKS
    names = args.only.split(",") if args.only else list(stacks)
    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    if args.dry_run:
        skipped(PROG, 'torch.cuda.set_sync_debug_mode("warn") around our forwards', "CUDA only (syncs read 0)")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_family_check: {args.device} ({gpu}), "
          f"{args.dtype}, backend {dflash_kernels.get_backend(device)}, tolerance {args.tol:g}")
    rows = []
    path = default_json(args.json, "gpu_family_check.json")
    report = dict(device=args.device, dtype=str(args.dtype), tolerance=args.tol, dry_run=args.dry_run, rows=rows,
                  complete=False)
    for name in names:
        t0 = time.perf_counter()
        rows += check_stack(name, stacks[name], args)
        print(f"  {name}: {time.perf_counter() - t0:.1f}s")
        write_json(path, report)  # what finished survives a kill
    print(f"{'stack':<12} {'check':<30} {'rel err logits':>14} {'rel err layer0':>14} {'argmax':>7} {'experts':>10} "
          f"{'syncs':>5}  result")
    for r in rows:
        print(f"{r['stack']:<12} {r['check']:<30} {r['rel_err_logits']:>14.2e} {r['rel_err_layer0']:>14.2e} "
              f"{r['argmax_agree']:>7.2f} {str(r['experts']):>10} {r['cuda_syncs_in_forwards']:>5}  "
              f"{'ok' if r['ok'] else 'FAIL'}")
    failed = [r for r in rows if not r["ok"]]
    report["complete"] = True
    write_json(path, report)
    if failed:
        for r in failed:
            print(f"gpu_family_check: FAIL {r['stack']} {r['check']}: relative error {r['rel_err_logits']:.2e} "
                  f"(logits), {r['rel_err_layer0']:.2e} (layer 0) over {args.tol:g}", file=sys.stderr)
        return 1
    print("gpu_family_check: every stack matches the model's own forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
