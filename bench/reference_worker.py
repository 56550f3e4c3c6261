"""The reference side of bench/reference_loops.py: one reference generation loop, served over stdin / stdout.

Runs in an environment with z-lab's ``dflash==0.1.0`` (and, for DDTree, a checkout of Liran Ringel's DDTree
code), never with this repository's ``dflash`` package: both import as ``dflash``, so this file imports nothing
from the repository (tests/test_reference_loops.py checks that). bench/reference_loops.py starts it; by hand::

    cd /tmp && PYTHONPATH= /tmp/venv-zlab/bin/python /path/to/repo/bench/reference_worker.py zlab
    cd /tmp && PYTHONPATH= /tmp/venv-zlab/bin/python /path/to/repo/bench/reference_worker.py ddtree --ddtree-src /tmp/ddtree_src

``zlab`` serves z-lab's ``dflash.model.dflash_generate``; ``ddtree`` serves ``ddtree.ddtree_generate`` of the
DDTree code at ``--ddtree-src`` (its top-level ``dflash.py`` and ``model/`` shadow z-lab's package there; it
needs ``loguru``, ``numpy`` and ``datasets`` importable). Both load the target with transformers' SDPA
attention in float32 and the drafter (z-lab's format: ``python -m dflash convert ... --format zlab``) with
SDPA too (the DDTree code would otherwise take its config's attention, flash-attn on a GPU checkpoint).
``torch.cuda.synchronize`` becomes a no-op: both loops time their stages with it, which a CPU build refuses.

Protocol: one JSON object per line in, one per line out (every other print goes to stderr).

* ``{"cmd": "setup", "target": DIR, "drafter": DIR, "threads": 1, "launches": PATH}`` -> ``{"ok": true, ...}``:
  loads the models; ``launches`` is dflash/benchmark/launches.py, loaded by path (it imports only torch).
* ``{"cmd": "generate", "prompts": [[ids]], "max_new_tokens": N, "temperature": T, "tree_budget": K,
  "seed": S}`` -> ``{"seconds": [...], "new_tokens": [[ids]], "rounds": [[accepted + 1 per round]]}``: each
  prompt once, timed alone (``time.perf_counter`` around the call: prefill, rounds, output handling).
* ``{"cmd": "count", ...the same keys}`` -> ``{"ops": [...], "by_op": [{op: n}], "rounds": [...]}``: each
  prompt once under the launch counter, inside ``torch.inference_mode()``.
* ``{"cmd": "quit"}``.

A command that raises answers ``{"error": TRACEBACK}``; a ``dflash`` that is not z-lab's installed package (or
no ``ddtree.py`` at ``--ddtree-src``) stops the worker before anything is loaded, its reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path


def _drop_own_directory():
    """The script's directory (bench/) is sys.path[0]: keep it out of the reference's imports."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != here]


class Reference:
    """Loads the target and the drafter; :meth:`generate` returns (new token ids, per-round tokens)."""

    def __init__(self, target_dir: str, drafter_dir: str, drafter_cls):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
        self.draft = drafter_cls.from_pretrained(drafter_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
        self.eos = self.target.generation_config.eos_token_id
        if isinstance(self.eos, int):
            self.eos = [self.eos]

    def describe(self) -> dict:
        import transformers

        return {"torch": self.torch.__version__, "transformers": transformers.__version__,
                "target_attn": self.target.config._attn_implementation,
                "drafter_attn": self.draft.config._attn_implementation, "stop_token_ids": self.eos}


class ZLab(Reference):
    @staticmethod
    def check(args):
        """Before anything heavy is imported: ``dflash`` must be z-lab's installed package."""
        spec = importlib.util.find_spec("dflash")
        origin = spec.origin if spec is not None else None
        if origin is None or "site-packages" not in origin:
            raise SystemExit(f"z-lab's dflash 0.1.0 must be installed; `import dflash` finds {origin} (run outside "
                             "the repository with an empty PYTHONPATH)")

    def __init__(self, target_dir, drafter_dir, args):
        import torch

        torch.cuda.synchronize = lambda *a, **k: None
        from dflash import model

        self.model = model
        super().__init__(target_dir, drafter_dir, model.DFlashDraftModel)

    def describe(self):
        import importlib.metadata

        return dict(super().describe(), impl="zlab", version=importlib.metadata.version("dflash"))

    def generate(self, ids, max_new_tokens, temperature, tree_budget):
        x = self.torch.tensor([ids], dtype=self.torch.long)
        res = self.model.dflash_generate(self.draft, self.target, x, max_new_tokens, self.eos,
                                         temperature=temperature, return_stats=True)
        return res.output_ids[0, len(ids):].tolist(), [int(n) for n in res.acceptance_lengths]


class DDTree(Reference):
    @staticmethod
    def check(args):
        if not (Path(args.ddtree_src) / "ddtree.py").is_file():
            raise SystemExit(f"no ddtree.py in --ddtree-src {args.ddtree_src}")

    def __init__(self, target_dir, drafter_dir, args):
        import torch

        torch.cuda.synchronize = lambda *a, **k: None
        src = str(Path(args.ddtree_src).resolve())
        sys.path.insert(0, src)
        import ddtree
        import model

        for mod in (ddtree, model):
            if not str(Path(mod.__file__).resolve()).startswith(src):
                raise SystemExit(f"{mod.__name__} imported from {mod.__file__}, not from {src}")
        self.ddtree = ddtree
        super().__init__(target_dir, drafter_dir, model.DFlashDraftModel)

    def describe(self):
        return dict(super().describe(), impl="ddtree", source=str(Path(self.ddtree.__file__).parent))

    def generate(self, ids, max_new_tokens, temperature, tree_budget):
        x = self.torch.tensor([ids], dtype=self.torch.long)
        res = self.ddtree.ddtree_generate(self.draft, self.target, x, mask_token_id=self.draft.mask_token_id,
                                          max_new_tokens=max_new_tokens, block_size=self.draft.block_size,
                                          stop_token_ids=self.eos, temperature=temperature, tree_budget=tree_budget)
        return res.output_ids[0, len(ids):].tolist(), [int(n) for n in res.acceptance_lengths]


IMPLS = {"zlab": ZLab, "ddtree": DDTree}


def serve(args, out) -> int:
    state: dict = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            return 0
        try:
            reply = handle(args, msg, state)
        except Exception:  # the caller reports it and stops this worker
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


def handle(args, msg: dict, state: dict) -> dict:
    cmd = msg["cmd"]
    if cmd == "setup":
        import torch

        torch.set_num_threads(int(msg.get("threads", 1)))
        spec = importlib.util.spec_from_file_location("_launches", msg["launches"])
        launches = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(launches)
        state["counter"] = launches.LaunchCounter
        state["ref"] = ref = IMPLS[args.impl](msg["target"], msg["drafter"], args)
        return dict(ok=True, **ref.describe())
    if cmd not in ("generate", "count"):
        return {"error": f"unknown command {cmd!r}"}
    ref = state["ref"]
    torch = ref.torch
    kw = dict(max_new_tokens=int(msg["max_new_tokens"]), temperature=float(msg.get("temperature", 0.0)),
              tree_budget=int(msg.get("tree_budget", 7)))
    reply: dict = {"seconds": [], "new_tokens": [], "rounds": [], "ops": [], "by_op": []}
    for i, ids in enumerate(msg["prompts"]):
        torch.manual_seed(int(msg.get("seed", 0)) + i)
        if cmd == "count":
            counter = state["counter"]()
            with torch.inference_mode(), counter:
                new, rounds = ref.generate(ids, **kw)
            reply["ops"].append(counter.total)
            reply["by_op"].append(dict(counter.by_op))
        else:
            t0 = time.perf_counter()
            new, rounds = ref.generate(ids, **kw)
            reply["seconds"].append(time.perf_counter() - t0)
        reply["new_tokens"].append(new)
        reply["rounds"].append(rounds)
    return reply


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("impl", choices=sorted(IMPLS))
    p.add_argument("--ddtree-src", default=None, help="a checkout of the DDTree code (ddtree.py, dflash.py, model/)")
    args = p.parse_args(argv)
    if args.impl == "ddtree" and not args.ddtree_src:
        p.error("ddtree needs --ddtree-src")
    _drop_own_directory()
    IMPLS[args.impl].check(args)
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol owns stdout; everything the references print goes to stderr
    return serve(args, out)


if __name__ == "__main__":
    sys.exit(main())
