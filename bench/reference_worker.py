"""The reference side of bench/reference_loops.py: one reference generation loop, served over stdin / stdout.

Runs with z-lab's ``dflash==0.1.0`` (and, for DDTree, a checkout of Liran Ringel's DDTree code), never with
this repository's ``dflash`` package: both import as ``dflash``, so this file imports nothing from the
repository (tests/tooling/test_reference_loops.py checks that). z-lab's package comes from its own environment (an
installed ``dflash``, found in ``site-packages``), or from ``--zlab-src DIR``, a directory holding z-lab's
``dflash/`` package folder (its installed files copied there: how it travels to a machine without network,
run by the same interpreter as ours). bench/reference_loops.py starts it; by hand::

    cd /tmp && PYTHONPATH= /tmp/venv-zlab/bin/python /path/to/repo/bench/reference_worker.py zlab
    cd /tmp && PYTHONPATH= python /path/to/repo/bench/reference_worker.py zlab --zlab-src /path/to/zlab_src
    cd /tmp && PYTHONPATH= /tmp/venv-zlab/bin/python /path/to/repo/bench/reference_worker.py ddtree --ddtree-src /tmp/ddtree_src

``zlab`` serves z-lab's ``dflash.model.dflash_generate``; ``ddtree`` serves ``ddtree.ddtree_generate`` of the
DDTree code at ``--ddtree-src`` (its top-level ``dflash.py`` and ``model/`` shadow z-lab's package there).
The DDTree code imports ``loguru`` and ``datasets`` at module level for logging and dataset loading, neither
of which its generation loop calls: where one is not installed, a stand-in takes its name (log lines go to
stderr; a dataset call raises). Both load the target with transformers' SDPA attention in float32 and the
drafter (z-lab's format: ``python -m dflash convert ... --format zlab``) with SDPA too (the DDTree code would
otherwise take its config's attention, flash-attn on a GPU checkpoint), on the setup's device. On the CPU
``torch.cuda.synchronize`` becomes a no-op (both loops time their stages with it, which a CPU build refuses);
on a GPU each timed call is bracketed by a synchronize.

Protocol: one JSON object per line in, one per line out (every other print goes to stderr).

* ``{"cmd": "setup", "target": DIR, "drafter": DIR, "threads": 1, "launches": PATH, "device": "cpu"}`` ->
  ``{"ok": true, ...}``: loads the models; ``launches`` is dflash/benchmark/launches.py, loaded by path (it
  imports only torch).
* ``{"cmd": "generate", "prompts": [[ids]], "max_new_tokens": N, "temperature": T, "tree_budget": K,
  "seed": S}`` -> ``{"seconds": [...], "new_tokens": [[ids]], "rounds": [[accepted + 1 per round]]}``: each
  prompt once, timed alone (``time.perf_counter`` around the call: prefill, rounds, output handling).
* ``{"cmd": "count", ...the same keys}`` -> ``{"ops": [...], "by_op": [{op: n}], "rounds": [...]}``: each
  prompt once under the launch counter, inside ``torch.inference_mode()``.
* ``{"cmd": "quit"}``.

A command that raises answers ``{"error": TRACEBACK}``; a ``dflash`` that is not z-lab's package (installed, or
under ``--zlab-src``) or no ``ddtree.py`` at ``--ddtree-src`` stops the worker before anything is loaded, its
reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
import types
from pathlib import Path


def _drop_own_directory():
    """The script's directory (bench/) is sys.path[0]: keep it out of the reference's imports."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != here]


def _stand_in(name: str, **attrs) -> None:
    """Register module ``name`` made of ``attrs`` unless the real one imports."""
    try:
        importlib.import_module(name)
    except ImportError:
        sys.modules[name] = types.SimpleNamespace(__name__=name, __stand_in__=True, **attrs)


def _no_dataset(*args, **kwargs):
    raise RuntimeError("datasets is not installed here: the reference worker only generates")


def _log(*args, **kwargs):
    print(*args, file=sys.stderr)


def _stand_ins() -> None:
    """loguru and datasets for the DDTree code's module-level imports, where they are not installed (see the
    module docstring)."""
    _stand_in("loguru", logger=types.SimpleNamespace(**{k: _log for k in (
        "trace", "debug", "info", "success", "warning", "error", "critical", "exception")}))
    _stand_in("datasets", load_dataset=_no_dataset, Features=_no_dataset, Sequence=_no_dataset,
              Value=_no_dataset)


def _synchronize(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Reference:
    """Loads the target and the drafter on ``device``; :meth:`generate` returns (new token ids, per-round
    tokens)."""

    def __init__(self, target_dir: str, drafter_dir: str, drafter_cls, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(device)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                           attn_implementation="sdpa").to(self.device).eval()
        self.draft = drafter_cls.from_pretrained(drafter_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").to(self.device).eval()
        self.eos = self.target.generation_config.eos_token_id
        if isinstance(self.eos, int):
            self.eos = [self.eos]

    def describe(self) -> dict:
        import transformers

        return {"torch": self.torch.__version__, "transformers": transformers.__version__,
                "device": str(self.device), "target_attn": self.target.config._attn_implementation,
                "drafter_attn": self.draft.config._attn_implementation, "stop_token_ids": self.eos}


class ZLab(Reference):
    @staticmethod
    def check(args):
        """Before anything heavy is imported: ``dflash`` must be z-lab's package, installed or under
        ``--zlab-src``."""
        if args.zlab_src:
            src = Path(args.zlab_src).resolve()
            if not (src / "dflash" / "model.py").is_file():
                raise SystemExit(f"no z-lab package at --zlab-src {src} (it must hold dflash/model.py)")
            sys.path.insert(0, str(src))
        spec = importlib.util.find_spec("dflash")
        origin = spec.origin if spec is not None else None
        where = str(Path(args.zlab_src).resolve()) if args.zlab_src else "site-packages"
        if origin is None or where not in origin:
            raise SystemExit(f"z-lab's dflash 0.1.0 must be installed or given by --zlab-src; `import dflash` finds "
                             f"{origin} (run outside the repository with an empty PYTHONPATH)")

    def __init__(self, target_dir, drafter_dir, args, device):
        import torch

        if torch.device(device).type == "cpu":
            torch.cuda.synchronize = lambda *a, **k: None
        from dflash import model

        self.model = model
        self.source = args.zlab_src
        super().__init__(target_dir, drafter_dir, model.DFlashDraftModel, device)

    def describe(self):
        import importlib.metadata

        try:
            version = importlib.metadata.version("dflash")
        except importlib.metadata.PackageNotFoundError:
            version = None
        if self.source:  # copied package files: no distribution metadata (or a foreign one)
            version = f"source at {Path(self.source).resolve()}"
        return dict(super().describe(), impl="zlab", version=version)

    def generate(self, ids, max_new_tokens, temperature, tree_budget):
        x = self.torch.tensor([ids], dtype=self.torch.long, device=self.device)
        res = self.model.dflash_generate(self.draft, self.target, x, max_new_tokens, self.eos,
                                         temperature=temperature, return_stats=True)
        return res.output_ids[0, len(ids):].tolist(), [int(n) for n in res.acceptance_lengths]


class DDTree(Reference):
    @staticmethod
    def check(args):
        if not (Path(args.ddtree_src) / "ddtree.py").is_file():
            raise SystemExit(f"no ddtree.py in --ddtree-src {args.ddtree_src}")

    def __init__(self, target_dir, drafter_dir, args, device):
        import torch

        if torch.device(device).type == "cpu":
            torch.cuda.synchronize = lambda *a, **k: None
        src = str(Path(args.ddtree_src).resolve())
        sys.path.insert(0, src)
        _stand_ins()
        import ddtree
        import model

        for mod in (ddtree, model):
            if not str(Path(mod.__file__).resolve()).startswith(src):
                raise SystemExit(f"{mod.__name__} imported from {mod.__file__}, not from {src}")
        self.ddtree = ddtree
        super().__init__(target_dir, drafter_dir, model.DFlashDraftModel, device)

    def describe(self):
        return dict(super().describe(), impl="ddtree", source=str(Path(self.ddtree.__file__).parent))

    def generate(self, ids, max_new_tokens, temperature, tree_budget):
        x = self.torch.tensor([ids], dtype=self.torch.long, device=self.device)
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
        state["ref"] = ref = IMPLS[args.impl](msg["target"], msg["drafter"], args, msg.get("device", "cpu"))
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
            _synchronize(torch, ref.device)
            t0 = time.perf_counter()
            new, rounds = ref.generate(ids, **kw)
            _synchronize(torch, ref.device)
            reply["seconds"].append(time.perf_counter() - t0)
        reply["new_tokens"].append(new)
        reply["rounds"].append(rounds)
    return reply


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("impl", choices=sorted(IMPLS))
    p.add_argument("--ddtree-src", default=None, help="a checkout of the DDTree code (ddtree.py, dflash.py, model/)")
    p.add_argument("--zlab-src", default=None, help="a directory holding z-lab's dflash/ package folder (instead "
                                                     "of an installed package)")
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
