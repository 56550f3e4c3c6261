"""Drafter training, one module per job, each importing only those above it in this list:

:mod:`.records` (the JSONL format and reader), :mod:`.regenerate` (chat data rewritten by the target),
:mod:`.data` (``python -m dflash.training.data``), :mod:`.objective` (the block loss, its math and shapes),
:mod:`.evaluation` (tau), :mod:`.checkpointing` (gradient checkpointing), :mod:`.distributed` (torchrun,
DDP, FSDP2, reductions), :mod:`.state` (safetensors + JSON training state), :mod:`.loop` (the trainer),
:mod:`.train` (``python -m dflash train``)."""

__all__: list = []  # nothing re-exported: each job is reached through its own module
