"""At most one host read per round: AR step, DFlash round and DDTree round, on both backends.

A round may read the device once (the committed tokens and their count, one
pinned copy on a GPU); everything else (last token, positions, the tree build
and walk, compaction indices, stage times) stays on the device. The counter
(tests/host_reads.py) sees every torch call made from Python, transformers'
layers included, and counts the ones that would block on a GPU, so the count
taken here on CPU tensors is the count a GPU run makes. The code before the
round redesign read 6 (DFlash) and 13 (DDTree) times per round with stage
timing on.
"""


import pytest
import torch

import dflash
import dflash_kernels
from host_reads import HostReadCounter, reads_per_round
from tiny_models import tiny_draft, tiny_target

PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 3, 11]  # this file's own, not prompts.PROMPT
BACKENDS = ["reference", "triton"]


def _backend(name):
    if name == "triton" and "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    return dflash_kernels.force_backend(name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method,temperature,filters", [
    ("ar", 0.0, {}), ("dflash", 0.0, {}), ("ddtree", 0.0, {}), ("dflash", 0.8, {}), ("ddtree", 0.8, {}),
    ("dflash", 0.8, {"top_k": 20, "top_p": 0.9, "min_p": 0.05}),  # the processed-distribution sampler
    ("dflash", 0.8, {"acceptance": "match"}),  # sampled, argmax drafts kept while they equal the samples
])
def test_one_host_read_per_round(backend, method, temperature, filters):
    target = tiny_target("qwen3", layers=3, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    kw = dict(method=method, max_new_tokens=14, temperature=temperature, seed=1, stage_timing=True, **filters)
    if method == "ddtree":
        kw["tree_budget"] = 6
    result = {}

    def run():
        result["r"] = dflash.generate(target, None if method == "ar" else draft, PROMPT, **kw)

    with _backend(backend):
        per_round, reads, marks = reads_per_round(run, "verify" if method == "ar" else "commit")
    assert len(marks) == result["r"].num_rounds >= 3
    assert max(per_round) <= 1, f"host reads per round {per_round}; the reads of the worst round: {reads}"
    assert min(per_round) == 1  # the committed tokens do come back once


def test_counter_sees_the_reads_the_old_loop_made():
    """The counter is not blind: the reads the round redesign removed are each counted."""
    counter = HostReadCounter()
    x = torch.arange(6)
    with counter:
        x.tolist()
        int(x[2])
        bool(x[1] > 0)
        torch.tensor([3], device=x.device)  # the old loop's blocking upload of the last token
        x.cpu()
        x[x > 2]
        torch.nonzero(x)
    assert counter.count == 7, counter.reads
