"""End-to-end benchmark (``python -m dflash bench``): :mod:`.run`; PNG plots: :mod:`.plots`; procfs memory readings: :mod:`.memory`."""
