"""Device launches per round of our eager loops on the tiny pair, held under the reference loops' own counts.

``dflash.benchmark.launches.LaunchCounter`` counts every aten op that computes (views, metadata and no-op
casts excluded) under inference mode, on the CPU's reference ops, as ``bench/reference_loops.py`` counts ours and z-lab's DFlash loop /
the DDTree reference loop; ops per round = (ops of a generation) - (ops of the same call with one new token),
over the rounds the longer one added. ``tests/fixtures/reference_loops/ops_per_round.json`` holds the
references' counts from that script's run (command inside). Our bound per method sits at what the loop does
now, so a launch that creeps back into a round fails here; it must stay at or under the reference's.
"""

import json
from pathlib import Path

import pytest
import torch

import dflash
import dflash_kernels
from dflash.benchmark.launches import LaunchCounter
from dflash.tiny.corpus import heldout_prompts
from dflash.tiny.pair import load_default_pair
from dflash.tiny.tokenizer import ByteTokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "reference_loops" / "ops_per_round.json"

#: our eager rounds' launches on the CPU reference ops (greedy, the tiny pair, 128-byte held-out prompts)
BOUND = {"dflash": 270, "ddtree": 322}


@pytest.fixture(scope="module")
def tiny_pair():
    target, draft, _ = load_default_pair()
    return target, draft


def _ops_and_rounds(target, draft, ids, method, max_new_tokens):
    kw = dict(method=method, max_new_tokens=max_new_tokens, do_sample=False)
    if method == "ddtree":
        kw["tree_budget"] = 7
    counter = LaunchCounter()
    with dflash_kernels.force_backend("reference"), torch.inference_mode(), counter:
        result = dflash.generate(target, draft, ids, **kw)
    return counter.total, len(result.accepted_depths)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_launches_per_round_stay_under_the_reference_loops(tiny_pair, method):
    target, draft = tiny_pair
    reference = json.loads(FIXTURE.read_text())["ops_per_round"][method]
    assert BOUND[method] <= reference["ops_per_round"], (
        f"our bound for {method} ({BOUND[method]}) is above {reference['implementation']}'s "
        f"{reference['ops_per_round']:.1f} launches per round")
    tok = ByteTokenizer()
    prompts = [torch.tensor(tok.encode(p) if isinstance(p, str) else list(p)) for p in heldout_prompts(2, 128, seed=0)]
    _ops_and_rounds(target, draft, prompts[0], method, 2)  # the once-per-model and per-method set-up
    ops = rounds = 0
    for ids in prompts:
        full_ops, full_rounds = _ops_and_rounds(target, draft, ids, method, 48)
        one_ops, one_rounds = _ops_and_rounds(target, draft, ids, method, 1)
        ops += full_ops - one_ops
        rounds += full_rounds - one_rounds
    assert rounds > 10
    per_round = ops / rounds
    assert per_round <= BOUND[method], f"{method}: {per_round:.1f} launches per round, bound {BOUND[method]}"
