"""The training state on disk (safetensors + JSON, verified before use, never unpickled), gradient checkpointing, logs."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch

import dflash_kernels
from dflash.training.records import write_jsonl
from dflash.training.train import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def reference_backend():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.tiny.tokenizer import ByteTokenizer

    d = tmp_path_factory.mktemp("state")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                                 tie_word_embeddings=True)).save_pretrained(d / "target")
    ByteTokenizer().save_pretrained(d / "target")
    g = torch.Generator().manual_seed(0)
    write_jsonl([{"input_ids": torch.randint(0, 256, (24,), generator=g).tolist()} for _ in range(3)], d / "data.jsonl")
    common = ["--target", str(d / "target"), "--data", str(d / "data.jsonl"), "--layers", "1", "--block-size", "4",
              "--batch-size", "2", "--blocks-per-seq", "2", "--quiet", "--threads", "1", "--no-tensorboard"]
    assert main(common + ["--out", str(d / "out"), "--steps", "2"]) == 0
    return d, common


def _copy_state(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _resume(run, state_dir, capsys):
    d, common = run
    rc = main(common + ["--out", str(state_dir.parent / "o"), "--state-dir", str(state_dir), "--steps", "3",
                        "--resume"])
    return rc, capsys.readouterr().err


def test_state_is_safetensors_and_json(run):
    d, _ = run
    files = sorted(p.name for p in (d / "out" / "training_state").iterdir())
    assert files == ["training_state-00000002.safetensors", "training_state.json"]
    meta = json.loads((d / "out" / "training_state" / "training_state.json").read_text())
    assert meta["step"] == 2 and meta["format"] == "dflash-drafter-training-state"
    assert [g["params"][:1] for g in meta["optimizer"]["param_groups"]] == [["layers.0.self_attn.q_proj.weight"],
                                                                            ["layers.0.self_attn.q_norm.weight"]]


@pytest.mark.parametrize("damage, message", [
    ("flip", "does not match the SHA-256"),
    ("truncate", "truncated or modified"),
    ("json", "is not valid JSON"),
    ("path", "must be a plain *.safetensors name"),
    ("pickle", "does not match the SHA-256"),
    ("pickle_rehashed", "is not a readable safetensors file"),
    ("missing", "nothing to resume"),
])
def test_damaged_state_is_refused_naming_the_file(run, tmp_path, capsys, damage, message):
    d, _ = run
    state = _copy_state(d / "out" / "training_state", tmp_path / "state")
    tensors = next(state.glob("*.safetensors"))
    meta_path = state / "training_state.json"
    named = tensors
    if damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[-3] ^= 0x40
        tensors.write_bytes(bytes(data))
    elif damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-100])
    elif damage == "json":
        meta_path.write_text(meta_path.read_text()[:-40])
        named = meta_path
    elif damage == "path":
        meta = json.loads(meta_path.read_text())
        meta["tensors"]["file"] = "../" + meta["tensors"]["file"]
        meta_path.write_text(json.dumps(meta))
        named = meta_path
    elif damage.startswith("pickle"):  # a pickle that would run code, put where the tensors were
        class Boom:
            def __reduce__(self):
                return (Path(tmp_path / "ran").write_text, ("code from the state ran",))

        payload = pickle.dumps(Boom())
        tensors.write_bytes(payload + b"\0" * (tensors.stat().st_size - len(payload)))
        if damage == "pickle_rehashed":  # the JSON edited to match: the tensor file is still only parsed
            import hashlib

            meta = json.loads(meta_path.read_text())
            meta["tensors"]["sha256"] = hashlib.sha256(tensors.read_bytes()).hexdigest()
            meta_path.write_text(json.dumps(meta))
    else:
        meta_path.unlink()
        (state / "training_state.pt").write_bytes(pickle.dumps({"step": 1}))
        named = state
    rc, err = _resume(run, state, capsys)
    assert rc == 2 and message in err and str(named) in err, err
    assert not (tmp_path / "ran").exists()


def test_training_sources_never_unpickle():
    """No torch.load / pickle in the trainer: resume reads only JSON and safetensors."""
    for path in (ROOT / "dflash" / "training").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", "") in (
                    "torch", "pickle"):
                pytest.fail(f"{path.name}:{node.lineno} calls {node.value.id}.load")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert "pickle" not in names, f"{path.name} imports pickle"


def test_gradient_checkpointing_gives_the_same_gradients():
    from dflash.target import TargetAdapter
    from dflash.training.checkpointing import enable_gradient_checkpointing
    from dflash.training.objective import BlockTrainingConfig, step_loss
    from dflash.training.records import TrainingSequence
    from tiny_models import tiny_draft, tiny_target

    target = tiny_target(layers=4, hidden=32)
    target.requires_grad_(False)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[1, 2]).train()
    adapter = TargetAdapter(target, [1, 2, 3])
    g = torch.Generator().manual_seed(0)
    seqs = [TrainingSequence(torch.randint(0, 90, (24,), generator=g), torch.ones(24, dtype=torch.bool), i)
            for i in range(2)]
    cfg = BlockTrainingConfig(4, blocks_per_seq=3, logit_layer=3)
    grads = []
    for checkpointed in (False, True):
        if checkpointed:
            enable_gradient_checkpointing(draft)
        draft.zero_grad(set_to_none=True)
        out = step_loss(draft, adapter, seqs, cfg, generators=[torch.Generator().manual_seed(i) for i in range(2)])
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters()})
    adapter.close()
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6)
    assert sorted(n for n, _ in draft.named_parameters()) == sorted(grads[0])  # names unchanged


def test_logs_jsonl_tensorboard_and_heldout_tau(run, tmp_path, monkeypatch):
    """One JSON line per --log-every steps (loss, block tau, tokens/s), the same scalars to TensorBoard when
    it is installed (a stand-in module here), and the held-out tau of a byte-level target without prompts."""
    import sys
    import types

    calls = []

    class Writer:
        def __init__(self, logdir):
            calls.append(("dir", logdir))

        def add_scalar(self, key, value, step):
            calls.append((key, value, step))

        def close(self):
            calls.append("closed")

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    d, common = run
    args = [a for a in common if a != "--no-tensorboard"]
    out = tmp_path / "o"
    assert main(args + ["--out", str(out), "--steps", "2", "--log-every", "1", "--eval-every", "2",
                        "--eval-num-prompts", "1", "--eval-prompt-len", "16", "--eval-new-tokens", "8"]) == 0
    lines = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(x["loss"] > 0 and x["block_tau"] >= 1 and x["tokens_per_s"] > 0 for x in lines)
    assert lines[1]["eval_tau_T0"] >= 1
    assert calls[0] == ("dir", str(out / "tensorboard")) and calls[-1] == "closed"
    assert {c[0] for c in calls[1:-1]} >= {"train/loss", "train/block_tau", "train/tokens_per_s", "train/eval_tau_T0"}
