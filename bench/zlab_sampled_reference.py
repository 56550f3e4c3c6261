"""Sampled acceptance of z-lab's ``dflash`` 0.1.0 for bench/sampled_acceptance.py (tests/fixtures/zlab_sampled/).

Runs in an environment with z-lab's package and NOT this one (both import as
``dflash``), on drafters z-lab's ``from_pretrained`` loads natively::

    python3 -m venv /tmp/venv-zlab
    /tmp/venv-zlab/bin/pip install torch==2.13.0            # the CPU wheel
    /tmp/venv-zlab/bin/pip install 'dflash[local]==0.1.0'    # z-lab's package, transformers 5.15
    # in this repository's environment: the tiny pair's drafters in z-lab's format, and the prompts
    python -m dflash convert --format zlab --dtype float32 dflash/assets/tiny/drafter /tmp/zlab_tiny/drafter
    python -m dflash convert --format zlab --dtype float32 dflash/assets/tiny/drafter2 /tmp/zlab_tiny/drafter2
    python bench/sampled_acceptance.py --write-prompts tests/fixtures/zlab_sampled
    # in z-lab's environment, outside the repository
    cd /tmp && export PYTHONPATH= OMP_NUM_THREADS=1 REPO=/path/to/repo
    /tmp/venv-zlab/bin/python $REPO/bench/zlab_sampled_reference.py $REPO/tests/fixtures/zlab_sampled \\
        --pair tiny $REPO/dflash/assets/tiny/target /tmp/zlab_tiny --seeds 20

The checked-in fixture holds the shipped tiny pair (its drafters converted to
z-lab's format). ``--pair zlab_fixture $REPO/tests/fixtures/zlab_dflash2/target
$REPO/tests/fixtures/zlab_dflash2`` adds tests/fixtures/zlab_dflash2's pair (a
random tiny Qwen3 target and drafters of z-lab's own classes with its drafter
scalars set; bench/zlab_reference.py); its drafters were fitted to the target's
greedy continuations, so sampled rounds there commit about one token.

For every drafter of the pair, temperature ``T`` and filter (none, or top-p 0.95 with
top-k 20) of the grid, z-lab's ``dflash_generate`` runs every prompt of
``prompts.json`` once per seed (``torch.manual_seed(1000 * seed + prompt
index)`` before each call: z-lab draws from torch's global generator), with
the target's eos (257) as the stop token and ``max_new_tokens`` new tokens. A run's rounds are its
``acceptance_lengths`` (the tokens each round committed, bonus included).
Per configuration ``acceptance.json`` records, per seed, the committed tokens
and rounds pooled over the prompts, their ratio ``tau_s``, and the mean and
standard error of ``tau_s`` over the seeds; plus the grid, seeds, prompts and
versions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script's z-lab loader
from zlab_reference import zlab  # noqa: E402

TEMPERATURES = (0.3, 0.7, 1.0)
FILTERS = {"none": dict(top_p=1.0, top_k=0), "top_p0.95_top_k20": dict(top_p=0.95, top_k=20)}
#: the drafter pairs: this repository's directories of each target and drafter (fp32 on both sides)
PAIRS = {"tiny": dict(target="dflash/assets/tiny/target", drafters=["drafter", "drafter2"],
                      drafter_dir="dflash/assets/tiny"),
         "zlab_fixture": dict(target="tests/fixtures/zlab_dflash2/target", drafters=["dflash", "dflash2"],
                              drafter_dir="tests/fixtures/zlab_dflash2")}
EOS = 257  # both targets' byte vocabulary's eos: the stop token on both sides


def load_drafter(model, path: Path):
    config = json.loads((path / "config.json").read_text())
    cls = model.DFlash2DraftModel if "DFlash2DraftModel" in config.get("architectures", []) else model.DFlashDraftModel
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def measure(model, draft, target, prompts, seeds, temperature, top_p, top_k, max_new_tokens):
    """``{"committed": [...], "rounds": [...], "tau": [...]}`` per seed, pooled over the prompts."""
    committed, rounds = [], []
    for seed in seeds:
        c = n = 0
        for i, ids in enumerate(prompts):
            torch.manual_seed(1000 * seed + i)
            with torch.no_grad():
                res = model.dflash_generate(draft, target, torch.tensor([ids]), max_new_tokens, [EOS],
                                            temperature=temperature, top_p=top_p, top_k=top_k, return_stats=True)
            c += sum(int(x) for x in res.acceptance_lengths)
            n += len(res.acceptance_lengths)
        committed.append(c)
        rounds.append(n)
    return dict(committed=committed, rounds=rounds, tau=[c / n for c, n in zip(committed, rounds)])


def summary(taus):
    mean = sum(taus) / len(taus)
    var = sum((t - mean) ** 2 for t in taus) / max(len(taus) - 1, 1)
    return mean, math.sqrt(var / len(taus))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the fixture directory (tests/fixtures/zlab_sampled), holding prompts.json")
    p.add_argument("--pair", nargs=3, metavar=("NAME", "TARGET", "DRAFTERS"), required=True,
                   help="the pair's name in the fixture (tiny, zlab_fixture), its target's directory and the "
                        "directory of its z-lab-format drafters")
    p.add_argument("--drafters", default=None, help="comma-separated drafter subdirectories (default: the pair's)")
    p.add_argument("--temperatures", default=",".join(str(t) for t in TEMPERATURES))
    p.add_argument("--filters", default=",".join(FILTERS))
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    model = zlab()
    import transformers
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(1)
    out = Path(args.out)
    prompts = json.loads((out / "prompts.json").read_text())["prompts"]
    pair, target_dir, drafter_dir = args.pair
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    seeds = list(range(args.seeds))
    path = out / "acceptance.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    record.update(zlab_dflash="0.1.0", torch=torch.__version__, transformers=transformers.__version__,
                  max_new_tokens=args.max_new_tokens, seeds=seeds, prompts=prompts, filters=FILTERS, eos=EOS,
                  seeding="torch.manual_seed(1000 * seed + prompt index)", pairs=PAIRS)
    configs = record.setdefault("configs", {})
    for name in (args.drafters or ",".join(PAIRS[pair]["drafters"])).split(","):
        draft = load_drafter(model, Path(drafter_dir) / name)
        for t in (float(x) for x in args.temperatures.split(",")):
            for f in args.filters.split(","):
                start = time.time()
                m = measure(model, draft, target, prompts, seeds, t, max_new_tokens=args.max_new_tokens, **FILTERS[f])
                mean, se = summary(m["tau"])
                key = f"{pair}/{name}/T={t}/{f}"
                configs[key] = dict(pair=pair, drafter=name, kind=type(draft).__name__, temperature=t, filter=f, **m,
                                    tau_mean=mean, tau_se=se)
                print(f"{key}: tau {mean:.3f} +- {se:.3f} ({time.time() - start:.0f} s)", flush=True)
                path.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
