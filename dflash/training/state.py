"""The resumable training state on disk: safetensors for tensors, JSON for the rest, nothing pickled.

A state directory holds two files::

    training_state.json                    step, elapsed seconds, history, drafter config, optimizer
                                           hyperparameters, and the name, size and SHA-256 of:
    training_state-<step>.safetensors      fp32 tensors: "model.<param>" and "optim.<param>.<moment>"

Reading never runs code from the directory: JSON is parsed as data,
safetensors holds raw tensors behind a JSON header, and the tensor file must
match the size and SHA-256 recorded in the JSON, so a truncated or modified
file is refused (:class:`StateError`, naming the file) before it is parsed.
The tensor file is named by its step and written before the JSON that
points to it (each through a temporary file and ``os.replace``), so an
interrupted save leaves the previous state whole; older tensor files are
removed once the new JSON is in place.

Tensors are keyed by parameter name, whole (not sharded), so a state
written by any world size and layout (DDP, FSDP, one process) resumes on any
other.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Union

import torch

__all__ = ["STATE_JSON", "FORMAT", "VERSION", "StateError", "TrainingState", "save_state", "load_state"]

STATE_JSON = "training_state.json"
FORMAT = "dflash-drafter-training-state"
VERSION = 1
_REQUIRED = {"format": str, "version": int, "step": int, "elapsed": (int, float), "history": list, "config": dict,
             "optimizer": dict, "tensors": dict}


class StateError(ValueError):
    """A training state that cannot be resumed from; the message names the file and what is wrong."""


@dataclass
class TrainingState:
    """What a run resumes from (see the module docstring for the file layout)."""

    step: int
    elapsed: float
    history: List[dict]
    config: dict
    optimizer: dict  # {"param_groups": [{hyperparameters..., "params": [names]}]}
    tensors: Dict[str, torch.Tensor]

    def model_tensors(self) -> Dict[str, torch.Tensor]:
        return {k[len("model."):]: v for k, v in self.tensors.items() if k.startswith("model.")}

    def optimizer_tensors(self, name: str) -> Dict[str, torch.Tensor]:
        prefix = f"optim.{name}."
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _replace_atomically(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def save_state(directory: Union[str, Path], state: TrainingState) -> Path:
    """Write ``state`` into ``directory`` (tensor file, then the JSON); returns the JSON's path."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"training_state-{int(state.step):08d}.safetensors"
    tmp = directory / (name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.tensors.items()}, str(tmp),
              metadata={"format": FORMAT})
    _replace_atomically(tmp, directory / name)
    meta = dict(format=FORMAT, version=VERSION, step=int(state.step), elapsed=float(state.elapsed),
                history=state.history, config=state.config, optimizer=state.optimizer,
                tensors=dict(file=name, bytes=(directory / name).stat().st_size, sha256=_sha256(directory / name)))
    tmp_json = directory / (STATE_JSON + ".tmp")
    tmp_json.write_text(json.dumps(meta, indent=1) + "\n")
    _replace_atomically(tmp_json, directory / STATE_JSON)
    for old in directory.glob("training_state-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return directory / STATE_JSON


def load_state(directory: Union[str, Path]) -> TrainingState:
    """Read and verify the state in ``directory``; :class:`StateError` naming the file when it is not sound."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    path = directory / STATE_JSON
    if not path.is_file():
        legacy = " (a training_state.pt of an older version is not read: it would need unpickling)" \
            if (directory / "training_state.pt").exists() else ""
        raise StateError(f"no {STATE_JSON} in {directory}: nothing to resume{legacy}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"{path} is not valid JSON ({e}): truncated or modified; refusing to resume") from None
    if not isinstance(meta, dict):
        raise StateError(f"{path} holds a {type(meta).__name__}, expected a JSON object")
    for key, kind in _REQUIRED.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise StateError(f"{path}: field {key!r} is missing or not a {getattr(kind, '__name__', kind)}")
    if meta["format"] != FORMAT or meta["version"] != VERSION:
        raise StateError(f"{path}: format {meta['format']!r} version {meta['version']}, expected {FORMAT!r} "
                         f"version {VERSION}")
    info = meta["tensors"]
    name = info.get("file")
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
        raise StateError(f"{path}: the tensor file name {name!r} must be a plain *.safetensors name in {directory}")
    tensor_path = directory / name
    if not tensor_path.is_file():
        raise StateError(f"{tensor_path} (named by {path}) does not exist")
    size = tensor_path.stat().st_size
    if size != info.get("bytes"):
        raise StateError(f"{tensor_path} has {size} bytes, {path} records {info.get('bytes')}: truncated or "
                         "modified; refusing to resume")
    if _sha256(tensor_path) != info.get("sha256"):
        raise StateError(f"{tensor_path} does not match the SHA-256 recorded in {path}: modified or corrupt; "
                         "refusing to resume")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise StateError(f"{tensor_path} is not a readable safetensors file ({e})") from None
    return TrainingState(step=meta["step"], elapsed=float(meta["elapsed"]), history=meta["history"],
                         config=meta["config"], optimizer=meta["optimizer"], tensors=tensors)
