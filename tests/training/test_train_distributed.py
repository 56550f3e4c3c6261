"""Drafter training under torchrun on the CPU (gloo, 2 processes) against one process.

One torchrun launch trains three world-2 runs (DDP; FSDP2 with the target sharded, gradient
checkpointing and gradient accumulation over micro-batches; DDP stopped at step 2 as a preempted job)
and the README's torchrun command as a smoke version (tests/tooling/test_recipes.py); the world-1 runs happen
in this process. At the same global batch the weights must agree up to fp32 summation order, and a run
resumed (on another world size) must reach the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dflash_kernels
from dflash.training.train import main

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32 reduction order only: measured 6e-8 after 3 AdamW steps
# a small DFlash2 drafter: its selector runs outside the drafter's forward (DDP) and is its own FSDP2 unit
DFLASH2 = ["--arch", "dflash2", "--conv-group-size", "8", "--selector-rank", "8", "--selector-top-k", "4"]


@pytest.fixture(autouse=True)
def reference_backend():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.tiny.tokenizer import ByteTokenizer

    d = tmp_path_factory.mktemp("world")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=256, tie_word_embeddings=True)).eval()
    model.save_pretrained(d / "target")
    ByteTokenizer().save_pretrained(d / "target")
    g = torch.Generator().manual_seed(0)
    with open(d / "data.jsonl", "w") as f:
        for n in range(6):  # unequal lengths and masks: the global normaliser must not assume equal blocks
            T = 30 + 4 * n
            f.write(json.dumps({"input_ids": torch.randint(0, 256, (T,), generator=g).tolist(),
                                "loss_mask": [0] * (6 + n) + [1] * (T - 6 - n)}) + "\n")
    common = ["--target", str(d / "target"), "--data", str(d / "data.jsonl"), "--layers", "1", "--block-size", "4",
              "--batch-size", "4", "--blocks-per-seq", "3", "--lr", "3e-3", "--warmup-steps", "1", "--seed", "1",
              "--quiet", "--log-every", "1", "--save-every", "0", "--threads", "1", "--no-tensorboard"]
    runs = {
        "ddp": ["--steps", "3", "--parallel", "ddp"],
        "fsdp": ["--steps", "3", "--parallel", "fsdp", "--shard-target", "--micro-batch-size", "1",
                 "--grad-checkpoint"],
        "ddp_stopped": ["--steps", "4", "--stop-at", "2", "--parallel", "ddp"],
        "ddp_dflash2": DFLASH2 + ["--steps", "3", "--parallel", "ddp"],
        "fsdp_dflash2": DFLASH2 + ["--steps", "3", "--parallel", "fsdp", "--micro-batch-size", "1"],
    }
    batch = [common + ["--out", str(d / name)] + extra for name, extra in runs.items()]
    # the README's torchrun command, as a smoke version, in the same launch (its inputs written first)
    sys.path.insert(0, str(ROOT / "tests" / "tooling"))
    from test_recipes import inputs_of, run_step, smoke_plan

    plan = smoke_plan(ROOT / "README.md", d / "readme")
    for step in [s for s in plan if s[3] is not None and s[4] == "run"]:
        assert step[1] == "train" and step[3] == ["--nproc-per-node", "2"], step[0]
        cwd = os.getcwd()
        os.chdir(ROOT)  # the README's paths are relative to the repository
        try:
            for needed in inputs_of(plan, step):
                run_step(needed)
        finally:
            os.chdir(cwd)
        batch.append(step[2])
    spec = d / "runs.json"
    spec.write_text(json.dumps(batch))
    # the reference kernels, as in this process (the Triton interpreter would only slow the ranks down)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               DFLASH_BACKEND="reference")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "train_world.py"), str(spec)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return d, common


def _weights(out: Path):
    state = json.loads((out / "training_state" / "training_state.json").read_text())
    return state, load_file(str(out / "training_state" / state["tensors"]["file"]))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def world1(setup):
    d, common = setup
    assert main(common + ["--out", str(d / "w1"), "--steps", "3"]) == 0
    return _weights(d / "w1")


@pytest.fixture(scope="module")
def world1_dflash2(setup):
    d, common = setup
    assert main(common + DFLASH2 + ["--out", str(d / "w1_dflash2"), "--steps", "3"]) == 0
    return _weights(d / "w1_dflash2")


@pytest.mark.parametrize("run", ["ddp", "fsdp", "ddp_dflash2", "fsdp_dflash2"])
def test_world2_matches_world1(setup, request, run):
    d, _ = setup
    state, tensors = _weights(d / run)
    ref_state, ref = request.getfixturevalue("world1_dflash2" if run.endswith("dflash2") else "world1")
    if run.endswith("dflash2"):
        assert any(k.startswith("model.candidate_selector.") for k in tensors)
        assert all(h["selector_loss"] == pytest.approx(r["selector_loss"], abs=1e-4)
                   for h, r in zip(state["history"], ref_state["history"]))
    assert state["step"] == 3
    assert _max_diff(tensors, ref) < TOL  # the drafter and both AdamW moments
    # the logged loss and block tau are reduced over both ranks: the global batch's, as world 1 logs them
    for h, r in zip(state["history"], ref_state["history"]):
        assert h["loss"] == pytest.approx(r["loss"], abs=1e-4) and h["block_tau"] == pytest.approx(r["block_tau"])
    log = json.loads((d / run / "train_log.json").read_text())
    assert log["world_size"] == 2 and log["parallel"] == run.split("_")[0]
    # written once: one tensor file, no leftovers of a second writer
    assert sorted(p.name for p in (d / run / "training_state").iterdir()) == [
        "training_state-00000003.safetensors", "training_state.json"]
    lines = (d / run / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


def test_readme_torchrun_command_ran(setup):
    d, _ = setup
    outs = list((d / "readme").glob("*/train_log.json"))
    assert outs and all(json.loads(p.read_text())["world_size"] == 2 for p in outs)


def test_micro_batches_accumulate_to_the_same_step(setup, world1):
    d, common = setup
    assert main(common + ["--out", str(d / "w1_micro"), "--steps", "3", "--micro-batch-size", "1"]) == 0
    assert _max_diff(_weights(d / "w1_micro")[1], world1[1]) < TOL


def test_resume_on_another_world_size_reaches_the_uninterrupted_weights(setup):
    d, common = setup
    stopped, _ = _weights(d / "ddp_stopped")
    assert stopped["step"] == 2
    assert main(common + ["--out", str(d / "ddp_stopped"), "--steps", "4", "--resume"]) == 0  # world 1 continues
    assert main(common + ["--out", str(d / "w1_4"), "--steps", "4"]) == 0
    resumed, straight = _weights(d / "ddp_stopped"), _weights(d / "w1_4")
    assert resumed[0]["step"] == straight[0]["step"] == 4
    assert _max_diff(resumed[1], straight[1]) < TOL
    assert [h["step"] for h in resumed[0]["history"]] == [1, 2, 3, 4]


def test_batch_not_divisible_by_world_is_refused(setup):
    from dflash.training.distributed import World
    from dflash.training.loop import _check_args
    from dflash.training.train import build_parser

    d, common = setup
    args = common + ["--out", str(d / "bad"), "--steps", "1"]
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        _check_args(build_parser().parse_args(args), World(rank=0, world_size=3))
