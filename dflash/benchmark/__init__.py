"""End-to-end benchmark (``python -m dflash bench``): :mod:`.run`; PNG plots: :mod:`.plots`; procfs memory readings: :mod:`.memory`."""

__all__: list = []  # nothing re-exported: each job is reached through its own module
