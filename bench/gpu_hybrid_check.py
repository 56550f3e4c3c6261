"""A Qwen3.5-27B-shaped hybrid stack on a GPU: verify + rollback vs transformers' own decode, and their latency.

Run on a GPU machine: ``python bench/gpu_hybrid_check.py`` (about 30 s on an H100-class GPU, Triton
compiles included); on a CPU (a test of the script): ``python bench/gpu_hybrid_check.py --device cpu --tiny``,
or ``--dry-run``: tiny widths, a smaller block / tree / prefix and one timed repetition, naming what it leaves
out (CUDA events: the wall clock times the steps).

The stack: transformers' ``Qwen3_5ForCausalLM`` cut to ``--layers`` decoder layers (default 4: three
Gated-DeltaNet layers then one full-attention layer, the real 3:1 pattern) at Qwen3.5-27B widths: hidden
5120, MLP 17408, attention 24 / 4 heads x 256 (partial rotary 0.25, multimodal-rope sections), linear
attention 16 key / 48 value heads x 128, conv kernel 4, vocabulary 248320; random bf16 weights.

Checks (relative error ``|ours - theirs| / |theirs|``, bound ``--tol``, bf16 default 3e-2):

* ``chain``: prefill ``--prefix`` random tokens, verify a ``--block``-token chain (logits vs the model's own
  forward on the same sequence), commit ``a + 1`` rows for ``a`` in ``--accept``: every linear layer's
  recurrent state and conv window vs transformers' own ``DynamicCache`` after decoding those tokens one by one;
* ``tree``: a ``--tree``-node random tree (parents drawn among the 8 previous nodes), verified in one pass,
  the path to its last node kept by the device compaction (``compact_advance``, device count): states vs
  transformers' decode of that path's tokens.

Latency (CUDA events, median of ``--reps`` after a warm-up; the committed state restored between reps,
outside the timed region): a plain decode step (one token through the model's own Gated-DeltaNet decode
on our cache, plus the target's argmax), the chain verify (forward + argmax) and its rollback
(``commit(a + 1)``: one replay launch over all linear layers + the conv windows), the tree verify
(ancestor bits, forward, argmax) and its commit (K/V compaction + replay). Each as a ratio to the decode
step. Also the bytes per linear layer of the two rollback designs at these shapes (analytic).

Prints a table; JSON to ``--json`` (or ``$OUT/gpu_hybrid_check.json``), written once the checks are done and
again with the latencies. Exit 1 if a check is over the bound.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import add_dry_run, apply_dry_run, default_json, fail_without_cuda, skipped, write_json  # noqa: E402

PROG = "gpu_hybrid_check"
QWEN35_27B = dict(
    hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=248320, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10]))
TINY = dict(QWEN35_27B, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, vocab_size=64, max_position_embeddings=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny widths (a CPU test of the script)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default) or float32 (default with --tiny)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th is full attention)")
    p.add_argument("--prefix", type=int, default=None, help="prompt tokens before the round (default 64; dry run 16)")
    p.add_argument("--block", type=int, default=None, help="chain verify tokens (default 16; dry run 8)")
    p.add_argument("--accept", default=None, help="accepted drafts a to commit (a + 1 rows each); default 0,7,15, "
                   "dry run 0,3,7")
    p.add_argument("--tree", type=int, default=None, help="tree nodes after the root (default 64; dry run 16)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; 2 with --tiny; dry run 1)")
    p.add_argument("--tol", type=float, default=None, help="relative error bound (bf16 3e-2, fp32 1e-4)")
    p.add_argument("--json", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, layers=4, prefix=16, block=8, accept="0,3,7", tree=16, reps=1, dtype=None)
    for key, value in (("prefix", 64), ("block", 16), ("accept", "0,7,15"), ("tree", 64)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    if args.tol is None:
        args.tol = 3e-2 if args.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if args.reps is None:
        args.reps = 2 if args.tiny else 20
    args.accept = [int(a) for a in args.accept.split(",")]
    if any(not 0 <= a < args.block for a in args.accept):
        raise SystemExit(f"--accept values must be in [0, {args.block}), got {args.accept}")
    return args


def build(shape: dict, layers: int, dtype, device, seed: int = 0):
    """The stack with random weights (decays spread over (0, 1), gated norms around 1)."""
    import transformers

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = transformers.Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=types, tie_word_embeddings=False,
                                            pad_token_id=0, eos_token_id=None, **shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(0.05, 2.0).log())
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1)
            elif "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.1)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
    return model.eval()


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.float(), theirs.float()
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))


def hf_cache_after(model, prompt: torch.Tensor, tokens: torch.Tensor):
    """transformers' own DynamicCache after prefilling ``prompt`` and decoding ``tokens`` one at a time."""
    from transformers import DynamicCache

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(prompt[None], use_cache=True, **{kw: cache})
        for t in tokens.tolist():
            model(torch.tensor([[t]], device=prompt.device), use_cache=True, **{kw: cache})
    return cache


def state_errors(ours, theirs) -> tuple:
    """Largest relative error over the linear layers: (recurrent states, conv windows)."""
    e_state = e_conv = 0.0
    for layer, slot in ours.linear.slots.items():
        e_state = max(e_state, rel_err(ours.linear.state[slot, 0], theirs.layers[layer].recurrent_states[0][0]))
        e_conv = max(e_conv, rel_err(ours.linear.conv[slot, 0].t(), theirs.layers[layer].conv_states[0][0]))
    return e_state, e_conv


def random_tree(n: int, g: torch.Generator):
    """Parents ``[n + 1]`` (root -1) with each node's parent among the 8 before it; depths; the last node's path."""
    parents = [-1]
    for i in range(1, n + 1):
        lo = max(0, i - 8)
        parents.append(int(torch.randint(lo, i, (1,), generator=g)))
    depths = [0] * (n + 1)
    for i in range(1, n + 1):
        depths[i] = depths[parents[i]] + 1
    path, node = [], n
    while node >= 0:
        path.append(node)
        node = parents[node]
    return torch.tensor(parents), torch.tensor(depths), path[::-1]


class Timer:
    """Median seconds of a callable: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int, setup=None) -> float:
        times = []
        for _ in range(reps):
            if setup is not None:
                setup()
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000.0)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def rollback_bytes(shape: dict, block: int, tree: int, accept: int) -> dict:
    """Bytes per linear layer of the two rollback designs (fp32 state, model-dtype activations of 2 bytes)."""
    hv, dk, dv = shape["linear_num_value_heads"], shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    channels = 2 * shape["linear_num_key_heads"] * dk + hv * dv
    state = hv * dk * dv * 4
    row = channels * 2 + hv * (4 + 2)  # q | k | v, g (fp32), beta
    return dict(state_bytes=state,
                checkpoint_chain=block * state, checkpoint_tree=(tree + 1) * state,
                replay_chain=2 * state + (accept + 1) * row, replay_stash_chain=block * (row + channels * 2),
                replay_tree=2 * state + (accept + 1) * row)


def main(argv=None) -> int:
    args = parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, ".."))
    import dflash_kernels
    from dflash.target import TargetAdapter

    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    if args.dry_run:
        skipped(PROG, "CUDA-event latencies", "CPU: the wall clock times the steps (the ratios mean nothing)")
    shape = TINY if args.tiny else QWEN35_27B
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t_start = time.perf_counter()
    model = build(shape, args.layers, args.dtype, device)
    V, P, B, N = model.config.vocab_size, args.prefix, args.block, args.tree
    print(f"gpu_hybrid_check: {args.device} ({gpu}), {args.dtype}, backend {dflash_kernels.get_backend(device)}, "
          f"{args.layers} layers ({sum(t == 'linear_attention' for t in model.config.layer_types)} linear), "
          f"tolerance {args.tol:g}; built in {time.perf_counter() - t_start:.1f}s")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (P + B,), generator=g).to(device)
    parents, depths, path = random_tree(N, g)
    tree_tokens = torch.randint(1, V, (N + 1,), generator=g)
    tree_tokens[0] = ids[P]  # the root: the first block token (the last committed one)
    parents, depths, tree_tokens = parents.to(device), depths.to(device), tree_tokens.to(device)
    rows = []

    def check(name, err, what):
        rows.append(dict(check=name, what=what, rel_err=err, ok=err <= args.tol))

    with torch.inference_mode():
        own_logits = model(ids[None]).logits[0]
    timer = Timer(device)
    timings = {}
    with torch.inference_mode(), TargetAdapter(model) as adapter:
        cache = adapter.new_cache(P + max(B, N + 1) + 8)
        adapter.prefill(ids[:P], cache)
        saved = (cache.linear.state.clone(), cache.linear.conv.clone(), cache.length)

        def restore():
            cache.linear.state.copy_(saved[0])
            cache.linear.conv.copy_(saved[1])
            cache.length = saved[2]
            cache.length_t.fill_(saved[2])  # both lengths: the eager passes read the first, compaction the second
            cache.linear.pending = None

        block = ids[P : P + B]
        block_pos = torch.arange(P, P + B, device=device)
        # ---------------------------------------------------------------- correctness: chain
        for a in args.accept:
            restore()
            h = adapter.forward(block, block_pos, cache)
            if a == args.accept[0]:
                check("chain verify logits", rel_err(adapter.logits(h), own_logits[P : P + B]), f"{B} tokens")
            cache.commit(a + 1)
            e_state, e_conv = state_errors(cache, hf_cache_after(model, ids[:P], block[: a + 1]))
            check(f"chain commit({a + 1}) state", e_state, "recurrent, worst layer")
            check(f"chain commit({a + 1}) conv", e_conv, "window, worst layer")
        # ---------------------------------------------------------------- correctness: tree
        restore()
        bits = dflash_kernels.ancestor_bits(parents)
        tree_pos = P + depths
        h = adapter.forward(tree_tokens, tree_pos, cache, tree_bits=bits, tree_parents=parents)
        path_t = torch.tensor(path, device=device)
        with torch.inference_mode():
            branch = torch.cat([ids[:P], tree_tokens[path_t]])
            branch_logits = model(branch[None]).logits[0, P:]
        check("tree verify logits (last node's path)", rel_err(adapter.logits(h[path_t]), branch_logits),
              f"{N + 1} nodes, path of {len(path)}")
        cache.compact_advance(path_t, torch.tensor([len(path)], device=device))
        cache.mirror(cache.length + len(path))
        e_state, e_conv = state_errors(cache, hf_cache_after(model, ids[:P], tree_tokens[path_t]))
        check(f"tree commit (path {len(path)}) state", e_state, "recurrent, worst layer")
        check(f"tree commit (path {len(path)}) conv", e_conv, "window, worst layer")
        out = default_json(args.json, "gpu_hybrid_check.json")
        report = dict(device=args.device, gpu=gpu, dtype=str(args.dtype), layers=args.layers, tolerance=args.tol,
                      dry_run=args.dry_run, checks=rows, latency_s=timings, complete=False)
        write_json(out, report)  # the checks survive a kill during the latencies

        # ---------------------------------------------------------------- latency
        one = ids[P : P + 1]
        one_pos = torch.tensor([P], device=device)

        def decode_step():
            hidden = adapter.forward(one, one_pos, cache)
            cache.commit(1)
            adapter.choose(hidden)

        for fn in (decode_step,):  # warm-up (Triton compiles)
            restore()
            fn()
        timings["decode step"] = timer(decode_step, args.reps, setup=restore)

        def chain_verify():
            adapter.choose(adapter.forward(block, block_pos, cache))

        a_mid = args.accept[len(args.accept) // 2]
        restore()
        chain_verify()
        cache.commit(a_mid + 1)  # warm-up of the replay
        timings[f"chain verify {B}"] = timer(chain_verify, args.reps, setup=restore)

        def chain_setup():
            restore()
            chain_verify()

        timings[f"chain rollback commit({a_mid + 1})"] = timer(lambda: cache.commit(a_mid + 1), args.reps,
                                                               setup=chain_setup)

        def tree_verify():
            b = dflash_kernels.ancestor_bits(parents, check=False)
            adapter.choose(adapter.forward(tree_tokens, tree_pos, cache, tree_bits=b, tree_parents=parents))

        count = torch.tensor([len(path)], device=device)

        def tree_commit():
            cache.compact_advance(path_t, count)
            cache.mirror(cache.length + len(path))

        restore()
        tree_verify()
        tree_commit()  # warm-up
        timings[f"tree verify {N + 1}"] = timer(tree_verify, args.reps, setup=restore)

        def tree_setup():
            restore()
            tree_verify()

        timings[f"tree commit (path {len(path)})"] = timer(tree_commit, args.reps, setup=tree_setup)
    base = timings["decode step"]
    bytes_ = rollback_bytes(shape, B, N, a_mid)
    print(f"{'check':<40} {'rel err':>10}  result")
    for r in rows:
        print(f"{r['check']:<40} {r['rel_err']:>10.2e}  {'ok' if r['ok'] else 'FAIL'}  ({r['what']})")
    print(f"{'latency':<40} {'ms':>10} {'x decode step':>14}")
    for k, v in timings.items():
        print(f"{k:<40} {v * 1e3:>10.3f} {v / base:>14.2f}")
    mib = 2 ** 20
    print(f"rollback bytes per linear layer: state {bytes_['state_bytes'] / mib:.1f} MiB; per-step checkpoints "
          f"{bytes_['checkpoint_chain'] / mib:.1f} MiB (chain {B}) / {bytes_['checkpoint_tree'] / mib:.1f} MiB "
          f"(tree {N + 1}); replay {bytes_['replay_chain'] / mib:.2f} MiB (a + 1 = {a_mid + 1} rows)")
    print(f"gpu_hybrid_check: total {time.perf_counter() - t_start:.1f}s")
    failed = [r for r in rows if not r["ok"]]
    report.update(rollback_bytes=bytes_, complete=True)
    write_json(out, report)
    if failed:
        for r in failed:
            print(f"gpu_hybrid_check: FAIL {r['check']}: relative error {r['rel_err']:.2e} over {args.tol:g}",
                  file=sys.stderr)
        return 1
    print("gpu_hybrid_check: every check matches transformers' own decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
