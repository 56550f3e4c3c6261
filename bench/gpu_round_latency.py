"""One verify round of DFlash / DDTree at Qwen3-8B shapes: our path against the plain-torch path.

Run on a GPU machine: ``python bench/gpu_round_latency.py [--layers 8] [--prefix 4096]``.
On a CPU (tests): ``python bench/gpu_round_latency.py --device cpu --tiny`` (small fp32
model, the ops on their reference backend; a check of the script, not of speed), or
``--dry-run``: the same with one timed round per path, naming what it leaves out (CUDA memory
statistics and synchronization).

The target is a ``Qwen3ForCausalLM`` with random weights (bf16) at Qwen3-8B shapes: hidden
4096, 32 query heads, 8 KV heads, head dim 128, MLP 12288, vocab 151936, but only
``--layers`` decoder layers (default 8 of 36, to fit the check's time budget; per-layer
costs scale with the layer count, the lm_head costs do not). The drafter's 5 captured layers
follow the published spread for that layer count. A committed prefix of ``--prefix`` tokens
is in both caches; then one round, timed end to end (median over ``--repeats``):

* ``dflash chain B``: verify ``[root, B-1 drafts]`` causally; all drafts accepted;
* ``ddtree budget N``: a best-first tree of N nodes built from random draft log-probs,
  verified with ancestor-only attention; the path to the deepest node is accepted.

Our path (what ``dflash.generate`` runs): ``TargetAdapter.forward`` with forward-hook capture
of the 5 layers and a static cache; attention through our one attention function (the
tree-attention kernel in chain mode for the chain, with the ancestor bitmask for the tree; GQA
packed, no mask); the target's choice at every row by the fused norm + lm_head + argmax; the
device walk; ``compact_kv_`` of the accepted rows with a device-side count (or a length bump for
the chain), ``gather_concat`` of their features, and the round's one host read.

Our path before the round redesign (``ours, dense SDPA``): the same round with the attention
of every layer replaced by what the adapter did before: a dense additive ``[1, 1, T, S]`` float
mask and SDPA over K/V expanded to every query head (``repeat_kv``), which is what HF's SDPA
path does once it is handed a mask. The speedup of the new attention path is ``dense / ours``.

Plain-torch path (what a transformers user writes): ``model(..., output_hidden_states=True)``
with a ``DynamicCache`` (every forward concatenates onto each layer's K/V), a dense
``[T, prefix + T]`` float mask built from the parent array by pointer jumping (the chain uses
transformers' own causal mask), full ``[T, vocab]`` logits and ``argmax``, the same walk,
``torch.cat`` of the 5 layers' hidden states and row selection, and the DynamicCache-style
commit: every layer's K/V re-concatenated as ``[prefix ; accepted rows]``.

Launches: one more round of each path runs under :class:`RoundLaunches` (untimed), which counts the aten ops
that compute and the Triton launches (``dflash.benchmark.launches.LaunchCounter``'s rules: each is one kernel
launch of an eager GPU round) and splits them into the ops inside the decoder layers' forwards (reported per
layer) and the rest of the round (embedding, rotary tables, mask or tree bits, head, walk, commit, features;
the plain path's DynamicCache commit re-concatenates every layer's K/V outside the layers' forwards and counts
there). Each launch has a host cost in an eager round whatever its size: read the counts next to the times
when ``speedup`` is below 1 (a gap the counts do not explain lies in the kernels' own time).

Both paths run on the same weights and inputs and are compared: share of equal target
choices (reported), and the relative error of the accepted rows' features and K/V. Exit
status 1 when those errors exceed 0.1 (bf16; 1e-4 in fp32), i.e. when a kernel result is
grossly wrong; ``bench/gpu_kernel_check.py`` checks every op against its reference exactly.
JSON goes to ``--json``, else ``$OUT/gpu_round_latency.json`` when ``OUT`` is set; it is
rewritten after each scenario, so a run cut short keeps the rows that finished.
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

PROG = "gpu_round_latency"
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, num_target_layers=36)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, num_target_layers=6)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small fp32 model (CPU test of this script)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the cut target (default 8; tiny 6)")
    p.add_argument("--captured", type=int, default=None, help="target layers read by the drafter (default 5; tiny 2)")
    p.add_argument("--prefix", type=int, default=None, help="committed tokens before the round (default 4096; tiny 48)")
    p.add_argument("--block", type=int, default=None, help="DFlash block size (default 16; tiny 8)")
    p.add_argument("--budgets", default=None, help="DDTree budgets, comma-separated (default 64,256; tiny 8,16)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per path (default 20; tiny 2)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default bf16; tiny fp32")
    p.add_argument("--json", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, layers=6, captured=2, prefix=48, block=8, budgets="8,16", repeats=1, dtype="float32")
    tiny = args.tiny
    defaults = dict(layers=6 if tiny else 8, captured=2 if tiny else 5, prefix=48 if tiny else 4096,
                    block=8 if tiny else 16, budgets="8,16" if tiny else "64,256", repeats=2 if tiny else 20,
                    dtype="float32" if tiny else "bfloat16")
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.budgets = [int(b) for b in str(args.budgets).split(",") if b.strip()]
    return args


def build_target(shape: dict, layers: int, dtype, device):
    """A Qwen3ForCausalLM with random weights, built directly on ``device`` in ``dtype``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], vocab_size=shape["vocab_size"], num_hidden_layers=layers,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


# ------------------------------------------------------------ the two paths
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def deepest_path(parents: torch.Tensor) -> torch.Tensor:
    """Node indices (root first) of the path from the root to the deepest node."""
    par = parents.tolist()
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    node, path = max(range(len(par)), key=lambda i: (depth[i], -i)), []
    while node >= 0:
        path.append(node)
        node = par[node]
    return torch.tensor(path[::-1], dtype=torch.int64)


class Scenario:
    """Inputs of one round: verify tokens and positions, tree (or chain), accepted node indices."""

    def __init__(self, name, tokens, depths, parents, accepted, prefix, chain):
        self.name, self.chain, self.prefix = name, chain, prefix
        self.tokens, self.depths, self.parents = tokens, depths, parents  # CPU: nodes 1..N, parents [N+1]
        self.accepted = accepted  # CPU int64, root first
        self.root = 7

    def to(self, device):
        self.ids_d = torch.cat([torch.tensor([self.root]), self.tokens]).to(device)
        self.pos_d = torch.cat([torch.zeros(1, dtype=torch.int64), self.depths.long()]).to(device) + self.prefix
        self.parents_d = self.parents.to(device)
        self.accepted_d = self.accepted.to(device)
        return self


def make_scenarios(block: int, budgets, vocab: int, prefix: int):
    import dflash_kernels as dk

    gen = torch.Generator().manual_seed(1)
    chain_tokens = torch.randint(0, vocab, (block - 1,), generator=gen)
    chain_parents = torch.arange(-1, block - 1)
    out = [Scenario(f"dflash chain B={block}", chain_tokens, torch.arange(1, block), chain_parents,
                    torch.arange(block), prefix, chain=True)]
    for budget in budgets:
        logits = torch.randn(block - 1, vocab, generator=gen) * 3
        logprobs, ids = torch.log_softmax(logits, -1).topk(min(budget, vocab), dim=-1)
        tokens, depths, parents, _ = dk.build_tree(logprobs, ids, budget)
        out.append(Scenario(f"ddtree budget {budget}", tokens, depths, parents, deepest_path(parents), prefix,
                            chain=False))
    return out


def our_round(adapter, cache, sc: Scenario):
    """One round on our path; returns (choices, features of the accepted rows)."""
    import dflash_kernels as dk

    cache.length = sc.prefix  # rows past the prefix are scratch
    cache.length_t.fill_(sc.prefix)
    if sc.chain:
        hidden = adapter.forward(sc.ids_d, sc.pos_d, cache)
        choices = adapter.choose(hidden)
        accepted = torch.cumprod((sc.ids_d[1:] == choices[:-1]).long(), 0).sum()
        torch.cat([choices, accepted[None]]).tolist()  # the loop's one host read
        cache.commit(sc.accepted.numel())
        features = adapter.context_features(rows=sc.accepted_d, trusted_rows=True)
    else:
        bits = dk.ancestor_bits(sc.parents_d, check=False)
        hidden = adapter.forward(sc.ids_d, sc.pos_d, cache, tree_bits=bits)
        choices = adapter.choose(hidden)
        # the loop's device walk and its one host read; the commit uses the scenario's fixed path
        _, path_len, committed = dk.walk_tree_device(sc.parents_d, sc.ids_d[1:], choices, int(sc.depths.max()),
                                                     bits=bits)
        n = torch.full((1,), sc.accepted.numel(), dtype=torch.int64, device=choices.device)
        padded = torch.cat([sc.accepted_d, sc.accepted_d[-1:].expand(int(sc.depths.max()) + 1 - n.numel())])
        cache.compact_advance(padded, n)
        features = adapter.context_features(rows=padded, trusted_rows=True)[: sc.accepted.numel()]
        torch.cat([committed, path_len]).tolist()
        cache.mirror(cache.length + sc.accepted.numel())
    return choices, features


class dense_mask_attention:
    """Context manager: our passes' attention as before the redesign (dense float mask, K/V per query head)."""

    def __enter__(self):
        import dflash.target.attention as attention
        from dflash_kernels import reference

        self.module, self.real = attention, attention.pass_attention

        def dense(query, key, value, attention_pass, window, scaling, softcap=None, sinks=None, backend=None):
            if softcap is not None or sinks is not None:  # not in the pre-redesign path: keep today's
                return self.real(query, key, value, attention_pass, window, scaling, softcap=softcap, sinks=sinks,
                                 backend=backend)
            T = query.shape[2]
            visible = reference.tree_visibility(attention_pass.bits, attention_pass.prefix_len, T,
                                                positions=attention_pass.positions, window=window,
                                                device=query.device)
            mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill_(~visible, torch.finfo(query.dtype).min)[None, None]
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)

        attention.pass_attention = dense
        return self

    def __exit__(self, *exc):
        self.module.pass_attention = self.real


def dense_tree_mask(parents: torch.Tensor, prefix: int, dtype, max_depth: int) -> torch.Tensor:
    """``[1, 1, T, prefix + T]`` additive mask: the prefix and each token's ancestors (itself included) visible.

    Plain torch on the device: pointer jumping up to ``max_depth`` levels, no host sync.
    """
    T = parents.numel()
    visible = torch.eye(T, dtype=torch.bool, device=parents.device)
    p = parents.clone()
    for _ in range(max_depth):
        valid = p >= 0
        visible |= torch.nn.functional.one_hot(p.clamp(min=0), T).bool() & valid[:, None]
        p = torch.where(valid, parents[p.clamp(min=0)], p)
    full = torch.cat([torch.ones(T, prefix, dtype=torch.bool, device=parents.device), visible], dim=1)
    mask = torch.zeros(T, prefix + T, dtype=dtype, device=parents.device)
    return mask.masked_fill_(~full, torch.finfo(dtype).min)[None, None]


def _cache_keyword(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _truncate(dyn, length: int) -> None:
    for layer in dyn.layers:
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def plain_round(model, dyn, layer_ids, sc: Scenario, max_depth: int):
    """One round as a transformers user writes it; returns (choices, features of the accepted rows)."""
    import dflash_kernels as dk

    _truncate(dyn, sc.prefix)
    kw = {_cache_keyword(model): dyn, "use_cache": True, "output_hidden_states": True}
    if sc.chain:
        out = model(input_ids=sc.ids_d[None], position_ids=sc.pos_d[None], **kw)
    else:
        mask = dense_tree_mask(sc.parents_d, sc.prefix, model.dtype, max_depth)
        out = model(input_ids=sc.ids_d[None], position_ids=sc.pos_d[None], attention_mask=mask, **kw)
    choices = out.logits[0].argmax(-1)
    if sc.chain:
        torch.cumprod((sc.ids_d[1:] == choices[:-1]).long(), 0).tolist()
        _truncate(dyn, sc.prefix + sc.accepted.numel())
    else:
        dk.walk_tree(sc.parents, sc.tokens, choices)
        rows = sc.prefix + sc.accepted_d
        for layer in dyn.layers:  # DynamicCache-style: [prefix ; accepted rows], re-concatenated
            layer.keys = torch.cat([layer.keys[:, :, : sc.prefix], layer.keys[:, :, rows]], dim=2)
            layer.values = torch.cat([layer.values[:, :, : sc.prefix], layer.values[:, :, rows]], dim=2)
    features = torch.cat([out.hidden_states[k + 1][0] for k in layer_ids], dim=-1)[sc.accepted_d]
    return choices, features


class RoundLaunches:
    """Counts one round's launches (``LaunchCounter``), split by where they run: ``in_layers`` inside the forwards
    of ``layers`` (the decoder layers), the rest outside. ``with RoundLaunches(layers) as c: ...``; then
    :meth:`summary`."""

    def __init__(self, layers):
        from dflash.benchmark.launches import LaunchCounter

        self.layers, self.counter, self.in_layers, self._hooks = list(layers), LaunchCounter(), 0, []

    def _enter_layer(self, module, args):
        self._start = self.counter.total

    def _leave_layer(self, module, args, out):
        self.in_layers += self.counter.total - self._start

    def __enter__(self):
        for layer in self.layers:
            self._hooks += [layer.register_forward_pre_hook(self._enter_layer),
                            layer.register_forward_hook(self._leave_layer)]
        self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        self.counter.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def summary(self) -> dict:
        """``total`` ops, ``triton`` launches among them, ``per_layer`` (ops inside one layer's forward, the mean)
        and ``per_round`` (every op outside the layers)."""
        c = self.counter
        return dict(total=c.total, triton=c.triton, per_layer=self.in_layers / max(len(self.layers), 1),
                    per_round=c.total - self.in_layers)


def count_launches(fn, layers) -> dict:
    """:meth:`RoundLaunches.summary` of one call of ``fn`` (one round)."""
    with RoundLaunches(layers) as launches:
        fn()
    return launches.summary()


def timed(fn, device, repeats: int, warmup: int):
    """(median ms, peak extra MiB on CUDA or None, last result) of ``fn`` run as whole rounds."""
    for _ in range(warmup):
        fn()
    times, peak = [], None
    result = None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            extra = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            peak = extra if peak is None else max(peak, extra)
    return statistics.median(times), peak, result


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# --------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    if args.dry_run:
        skipped(PROG, "torch.cuda.synchronize and the CUDA peak-memory columns", "CUDA only (MiB columns read n/a)")
    from transformers import DynamicCache

    import dflash_kernels as dk
    from dflash.drafter.config import default_target_layer_ids
    from dflash.target import TargetAdapter

    shape = TINY if args.tiny else QWEN3_8B
    dtype = getattr(torch, args.dtype)
    max_rows = max(args.budgets + [args.block]) + 1
    model = build_target(shape, args.layers, dtype, device)
    layer_ids = default_target_layer_ids(args.layers, args.captured)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, shape["vocab_size"], (args.prefix,), generator=gen).to(device)
    scenarios = [s.to(device) for s in make_scenarios(args.block, args.budgets, shape["vocab_size"], args.prefix)]
    warmup = 1 if args.tiny else 3

    ours = {}
    with torch.inference_mode():
        adapter = TargetAdapter(model, layer_ids)
        try:
            cache = adapter.new_cache(args.prefix + max_rows + 8)
            adapter.prefill(prompt, cache)
            for sc in scenarios:
                with dense_mask_attention():
                    dense_ms, _, _ = timed(lambda: our_round(adapter, cache, sc), device, args.repeats, warmup)
                ms, peak, (choices, feats) = timed(lambda: our_round(adapter, cache, sc), device, args.repeats, warmup)
                launches = count_launches(lambda: our_round(adapter, cache, sc), adapter.layers)
                n = sc.accepted.numel()
                kv_rows = cache.kv[:, :, :, args.prefix: args.prefix + n].clone()
                ours[sc.name] = dict(ms=ms, dense_ms=dense_ms, peak=peak, choices=choices.clone(),
                                     features=feats.clone(), kv=kv_rows, launches=launches)
            backend = dk.get_backend(device)
            tree_backend = ("tree-attention kernel (GQA packed, no mask)" if backend == "triton"
                            else "SDPA with a [T, S] mask (reference backend)")
        finally:
            adapter.close()
        del cache

        rows = []
        limit = 1e-4 if dtype == torch.float32 else 0.1
        report = dict(
            device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            dtype=args.dtype, shape=shape, layers=args.layers, note=(
                f"target cut to {args.layers} of {shape['num_target_layers']} decoder layers, random weights"),
            captured_layers=layer_ids, prefix=args.prefix, repeats=args.repeats, kernel_backend=dk.get_backend(device),
            tree_verify=tree_backend, error_limit=limit, dry_run=args.dry_run, rows=rows, failed=[], complete=False)
        path = default_json(args.json, "gpu_round_latency.json")
        dyn = DynamicCache(config=model.config)
        model(input_ids=prompt[None], **{_cache_keyword(model): dyn, "use_cache": True})
        for sc in scenarios:
            ms, peak, (choices, feats) = timed(lambda: plain_round(model, dyn, layer_ids, sc, args.block - 1), device,
                                               args.repeats, warmup)
            launches = count_launches(lambda: plain_round(model, dyn, layer_ids, sc, args.block - 1),
                                      model.model.layers)
            n = sc.accepted.numel()
            plain_kv = torch.stack([torch.stack([layer.keys[0, :, args.prefix: args.prefix + n],
                                                 layer.values[0, :, args.prefix: args.prefix + n]])
                                    for layer in dyn.layers])
            mine = ours[sc.name]
            rows.append(dict(
                scenario=sc.name, tree_tokens=int(sc.ids_d.numel()), accepted_rows=n,
                ours_ms=mine["ms"], dense_ms=mine["dense_ms"], attention_speedup=mine["dense_ms"] / mine["ms"],
                plain_ms=ms, speedup=ms / mine["ms"],
                ours_peak_extra_mib=mine["peak"], plain_peak_extra_mib=peak,
                choices_agree=float((mine["choices"] == choices).float().mean()),
                feature_rel_err=rel_err(mine["features"], feats), kv_rel_err=rel_err(mine["kv"], plain_kv),
                ours_launches=mine["launches"], plain_launches=launches,
            ))
            row = rows[-1]
            if not (row["feature_rel_err"] <= limit and row["kv_rel_err"] <= limit):
                report["failed"].append(sc.name)
            write_json(path, report)  # what finished survives a kill

    failed = report["failed"]
    report["complete"] = True
    print_table(report)
    write_json(path, report)
    if path:
        print(f"wrote {path}")
    if failed:
        print(f"FAILED: our path's features or K/V differ from the plain path beyond {limit:g} (relative) in: "
              + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


def _mib(x):
    return "n/a" if x is None else f"{x:.1f}"


def print_table(r: dict) -> None:
    s = r["shape"]
    print(f"== one verify round on {r['device_name']}: Qwen3 hidden {s['hidden_size']}, {s['num_attention_heads']}/"
          f"{s['num_key_value_heads']} heads x {s['head_dim']}, vocab {s['vocab_size']}, {r['dtype']}; "
          f"{r['note']}; prefix {r['prefix']}; captured layers {r['captured_layers']}; kernels: "
          f"{r['kernel_backend']}, tree verify: {r['tree_verify']}; median of {r['repeats']}")
    head = (f"{'scenario':<22}{'T':>5}{'acc':>5}{'ours ms':>10}{'dense ms':>10}{'vs dense':>9}{'plain ms':>10}"
            f"{'speedup':>9}{'ours MiB':>10}{'plain MiB':>11}{'agree':>7}{'feat err':>10}{'kv err':>10}")
    print(head)
    print("-" * len(head))
    for row in r["rows"]:
        print(f"{row['scenario']:<22}{row['tree_tokens']:>5}{row['accepted_rows']:>5}{row['ours_ms']:>10.3f}"
              f"{row['dense_ms']:>10.3f}{row['attention_speedup']:>8.2f}x"
              f"{row['plain_ms']:>10.3f}{row['speedup']:>8.2f}x{_mib(row['ours_peak_extra_mib']):>10}"
              f"{_mib(row['plain_peak_extra_mib']):>11}{row['choices_agree']:>7.2f}{row['feature_rel_err']:>10.2e}"
              f"{row['kv_rel_err']:>10.2e}")
    print("(dense: our round with the pre-redesign attention, dense float mask + K/V per query head; "
          "vs dense: dense ms / ours ms)")
    print("(T: verified tokens; acc: accepted rows; MiB: peak memory above the round's start, CUDA only; agree: share "
          "of equal target choices; errors: relative, ours vs plain)")
    head = (f"{'launches per round':<22}{'ours':>7}{'/layer':>8}{'rest':>6}{'triton':>8}{'plain':>8}{'/layer':>8}"
            f"{'rest':>6}")
    print(head)
    print("-" * len(head))
    for row in r["rows"]:
        o, p = row["ours_launches"], row["plain_launches"]
        print(f"{row['scenario']:<22}{o['total']:>7}{o['per_layer']:>8.1f}{o['per_round']:>6}{o['triton']:>8}"
              f"{p['total']:>8}{p['per_layer']:>8.1f}{p['per_round']:>6}")
    print("(aten ops that compute + Triton launches of one round, each one kernel launch on a GPU; /layer: inside "
          "one decoder layer's forward; rest: the round outside the layers; triton: Triton launches among ours)")


if __name__ == "__main__":
    sys.exit(main())
