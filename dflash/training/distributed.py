"""One training process per rank under ``torchrun``: the process group, the drafter's wrapper, reductions.

``torchrun --nproc-per-node N -m dflash train ...`` (or any torchrun
launch, multi-node included) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and the rendezvous variables; :func:`init_world` joins that group, with NCCL
when the rank drives a CUDA device and gloo on the CPU. A plain ``python -m
dflash train`` is world 1: no process group, every reduction is the value
itself.

Parallel layouts of the drafter (:func:`wrap_drafter`):

* ``ddp``: ``DistributedDataParallel``; each rank holds the whole drafter and
  its optimizer state, gradients are averaged with all-reduce.
* ``fsdp``: FSDP2 ``fully_shard`` on every drafter layer, then on the
  drafter (``fc``, norms): parameters, gradients and AdamW moments are
  sharded along dim 0 (a rank holds ``1/N`` of each), gathered layer by
  layer for the forward and the backward, gradients reduce-scattered.

Both average gradients over ranks, so a rank's loss is multiplied by ``N``
(:func:`gradient_scale`): with rank ``r`` contributing
``l_r = sum_{its blocks} w_k CE / W`` (``W`` the global batch's weight sum),
the averaged gradient is ``(1/N) sum_r N dl_r = d(sum_r l_r)``, the
gradient of the global loss, as world 1 computes it (up to the order of
fp32 additions).

The frozen target is replicated on every rank, or (``shard_target``, with
``fsdp``) its decoder layers are sharded with ``fully_shard`` and gathered
one layer at a time during the no-grad target pass, for a target that does
not fit one device (embedding, final norm and lm_head stay replicated: the
fused label and loss kernels read them whole).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "PARALLEL_CHOICES",
    "World",
    "init_world",
    "wrap_drafter",
    "gradient_sync",
    "gradient_scale",
    "shard_target_layers",
    "is_sharded",
    "full_tensor",
    "full_parameters",
    "load_full_",
]

PARALLEL_CHOICES = ("ddp", "fsdp")


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without distributed support
        return None
    return DTensor


@dataclass
class World:
    """This process's place: ``rank`` of ``world_size``, ``local_rank`` on its node, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None  # None: world 1, no process group
    owns_group: bool = False  # this World created the process group (and so destroys it on close)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def all_reduce_sum(self, values: Sequence[float]) -> List[float]:
        """Elementwise sums of ``values`` over ranks (float64, one collective)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def broadcast_float(self, value: float) -> float:
        """Rank 0's ``value`` on every rank (decisions that must agree: time budgets, stop)."""
        if not self.distributed:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device())
        dist.broadcast(t, src=0)
        return float(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_world(device: Optional[str] = None) -> World:
    """Join torchrun's process group when ``WORLD_SIZE > 1``; pick this rank's device.

    ``device``: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available). A
    CUDA rank uses ``cuda:LOCAL_RANK`` and NCCL, a CPU rank gloo. A group
    the caller already initialised is used as it is (and left open).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be 'cpu' or 'cuda', got {device!r}")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to this process")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices on this node; "
                             "give torchrun --nproc-per-node at most the device count")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world_size <= 1:
        return World(device=dev)
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = "nccl" if use_cuda else "gloo"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend=backend, device_id=dev if use_cuda else None)
    elif dist.get_backend() != backend:
        raise ValueError(f"the process group uses {dist.get_backend()}, this rank's device {dev} needs {backend}")
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=backend,
                 owns_group=owns)


def wrap_drafter(draft: torch.nn.Module, world: World, parallel: str):
    """What to call for the drafter's training forward: the drafter itself (world 1, ``fsdp``) or its DDP wrapper.

    ``fsdp`` shards ``draft`` in place (each of ``draft.layers``, a DFlash2
    drafter's ``candidate_selector``, then the root); call this after its weights are loaded and before the optimizer
    is built.
    """
    if parallel not in PARALLEL_CHOICES:
        raise ValueError(f"--parallel must be one of {', '.join(PARALLEL_CHOICES)}, got {parallel!r}")
    if not world.distributed:
        return draft
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [world.device.index] if world.device.type == "cuda" else None
        return DistributedDataParallel(draft, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world)
    for layer in draft.layers:
        fully_shard(layer, mesh=mesh)
    selector = getattr(draft, "candidate_selector", None)
    if selector is not None:  # DFlash2: called by the objective outside the drafter's forward
        fully_shard(selector, mesh=mesh)
    fully_shard(draft, mesh=mesh)
    return draft


def _mesh(world: World):
    """The 1-D device mesh of all ranks on this rank's device type (FSDP2 would otherwise pick CUDA whenever
    it is available, even for a gloo group of CPU ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(world.device.type, (world.world_size,))


@contextlib.contextmanager
def gradient_sync(forward, draft: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Inside: backward passes reduce gradients across ranks only when ``enabled`` (the last micro-batch).

    DDP: ``no_sync()`` for the others; FSDP2: ``set_requires_gradient_sync``.
    Gradients accumulate locally meanwhile, so accumulation over ``m``
    micro-batches costs one reduction per step.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(forward, DistributedDataParallel) and not enabled:
        with forward.no_sync():
            yield
        return
    if hasattr(draft, "set_requires_gradient_sync"):
        draft.set_requires_gradient_sync(enabled)
    yield


def gradient_scale(world: World) -> float:
    """The factor on a rank's loss that turns the wrappers' gradient average into the global sum: ``N``."""
    return float(world.world_size) if world.distributed else 1.0


def shard_target_layers(layers: Sequence[torch.nn.Module], world: World) -> None:
    """FSDP2-shard each frozen target decoder layer (gathered for its forward, freed after it)."""
    if not world.distributed:
        return
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)


def is_sharded(t: torch.Tensor) -> bool:
    DTensor = _dtensor_type()
    return DTensor is not None and isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded one (a collective for a DTensor: every rank must call it)."""
    return t.full_tensor() if is_sharded(t) else t


def full_parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``{name: whole fp32 parameter on the CPU}`` (collective under FSDP)."""
    return {name: full_tensor(p.detach()).float().cpu() for name, p in model.named_parameters()}


def load_full_(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor ``full`` into ``dst``: all of it, or this rank's shard of a DTensor (collective)."""
    if is_sharded(dst):
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(full.to(device=dst.device, dtype=dst.dtype), dst.device_mesh, dst.placements)
        dst.to_local().copy_(shard.to_local())
    else:
        dst.copy_(full.to(device=dst.device, dtype=dst.dtype))
