"""A stand-in for a Triton kernel that records its launches instead of running.

Tests that prove an op reads no tensor value on the host run it on meta tensors (no values:
any host read raises) with the op's kernel swapped for a :class:`KernelStub`.
"""


class KernelStub:
    """``stub[grid](*args, **kwargs)`` records ``(grid, args, kwargs)`` in ``launches``."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch
