"""The reference rows of bench/headline.py: z-lab's ``dflash_generate`` or the DDTree reference, one timed call.

Runs in a process of its own, started by ``bench/headline.py`` with an empty ``PYTHONPATH``, because the
references import as ``dflash`` (z-lab's package) or shadow it (the DDTree code's top-level ``dflash.py``): this
file imports nothing from this repository's ``dflash``; it loads ``gpu_round_latency.py`` (torch and
transformers only) and ``reference_worker.py`` (the DDTree code's stand-ins) by path::

    python bench/headline_refs.py zlab --src runs/refsrc/zlab --setup setup.pt --out result.json
    python bench/headline_refs.py ddtree --src runs/refsrc/ddtree --setup setup.pt --out result.json

``setup.pt`` (``torch.save`` of a dict): ``shape``, ``layers``, ``dtype``, ``device``, ``prompt [P]``,
``new_tokens``, ``taus``, per tau ``tables [R, H]`` (the steered block states by position, bench/headline.py's
``CostedSteeredDraft.table``) and ``tree_budgets`` (the DDTree reference's fixed budget), ``drafter`` (our
drafter in z-lab's format, a directory) and ``checksum`` (of the target's weights). The target is
rebuilt here with ``build_target``'s seed (the same weights on the same device: the checksum must match, else
exit 3); the reference's drafter is loaded from ``drafter`` and its forward wrapped: its real output
``[b, T, H]`` is computed (its cost is paid), then its last ``T`` rows are replaced by ``table[position_ids]``
(``+ 0 * output``), the states our steered drafter gives at the same positions, so both loops see the same
drafts. Per tau: one untimed warm-up call, then one timed call (synchronized ``perf_counter``, CUDA peak memory
reset before it). ``result.json``, rewritten after each tau: a list, per tau done, of ``tokens``,
``new_tokens``, ``wall_s``, ``tokens_per_s``, ``tau``, ``rounds``, ``peak_gib``, ``peak_above_start_gib``,
``source``, ``tree_budget``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checksum(model) -> float:
    """Sum of a few of the target's weights in fp64: the same build on the same device gives the same number
    (bench/headline.py sends it, this process checks it)."""
    import torch

    with torch.no_grad():
        weights = (model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight,
                   model.model.layers[-1].self_attn.o_proj.weight)
        return float(sum(p.detach().double().sum() for p in weights))


def steer(draft, steered: dict):
    """Wrap ``draft.forward``: its output's last rows become ``steered["table"][position_ids]`` (module
    docstring)."""
    real_forward = draft.forward

    def forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        positions = kwargs.get("position_ids")
        if positions is None or not hasattr(out, "shape") or out.dim() != 3:
            raise TypeError("the reference drafter's forward was not called as expected (position_ids=..., "
                            f"returning [b, T, H]); got {type(out).__name__}")
        T, table = out.shape[1], steered["table"]
        rows = positions[:, -T:].clamp(max=table.shape[0] - 1)
        return table[rows].to(out.dtype) + out * 0

    draft.forward = forward
    return draft


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("impl", choices=["zlab", "ddtree"])
    p.add_argument("--src", required=True)
    p.add_argument("--setup", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    latency = load("gpu_round_latency")  # torch + transformers; its directory joins sys.path
    worker = load("reference_worker")  # imports nothing from this repository
    sys.path[:] = [s for s in sys.path if s and Path(s).resolve() != HERE]
    import torch

    setup = torch.load(args.setup, weights_only=False)
    device = torch.device(setup["device"])
    if device.type == "cpu":
        torch.cuda.synchronize = lambda *a, **k: None  # the references time their stages with it
    dtype = getattr(torch, setup["dtype"])
    src = str(Path(args.src).resolve())
    sys.path.insert(0, src)
    if args.impl == "ddtree":
        worker._stand_ins()
        import ddtree as module
        from model import DFlashDraftModel
    else:
        from dflash import model as module
        DFlashDraftModel = module.DFlashDraftModel
    if not str(Path(module.__file__).resolve()).startswith(src):
        print(f"{module.__name__} imported from {module.__file__}, not from {src}", file=sys.stderr)
        return 2
    target = latency.build_target(setup["shape"], setup["layers"], dtype, device)
    if checksum(target) != setup["checksum"]:
        print("the rebuilt target's weights differ from bench/headline.py's", file=sys.stderr)
        return 3
    draft = DFlashDraftModel.from_pretrained(setup["drafter"], dtype=dtype, attn_implementation="sdpa")
    steered = {"table": None}
    draft = steer(draft.to(device).eval(), steered)
    prompt = setup["prompt"].to(device)[None]
    n = setup["new_tokens"]
    results = []
    for table, tree_budget in zip(setup["tables"], setup["tree_budgets"]):
        steered["table"] = table.to(device)

        def call():
            if args.impl == "zlab":
                return module.dflash_generate(draft, target, prompt, n, None, temperature=0.0, return_stats=True)
            return module.ddtree_generate(draft, target, prompt, mask_token_id=draft.mask_token_id,
                                          max_new_tokens=n, block_size=draft.block_size, stop_token_ids=None,
                                          temperature=0.0, tree_budget=int(tree_budget))

        call()  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        res = call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        tokens = res.output_ids[0, prompt.shape[1]:].tolist()[:n]
        rounds = [int(a) for a in res.acceptance_lengths]
        out = dict(state="ok", tokens=tokens, new_tokens=len(tokens), wall_s=wall, tokens_per_s=len(tokens) / wall,
                   tau=sum(rounds) / max(len(rounds), 1), rounds=len(rounds), source=src, peak_gib=None,
                   peak_above_start_gib=None, tree_budget=int(tree_budget) if args.impl == "ddtree" else None)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            out.update(peak_gib=peak / 2 ** 30, peak_above_start_gib=(peak - base) / 2 ** 30)
        results.append(out)
        tmp = Path(f"{args.out}.tmp")
        tmp.write_text(json.dumps(results))
        tmp.replace(args.out)  # a process stopped later keeps the taus it finished
    return 0


if __name__ == "__main__":
    sys.exit(main())
