"""Peak resident memory of this process on Linux, read from procfs (CPU memory measurements).

``reset_peak_rss()`` sets the kernel's high-water mark ``VmHWM`` back to the
current RSS (``/proc/self/clear_refs`` = 5); ``proc_status_kib("VmHWM")`` then
reads the peak since the reset. Both return None / False where procfs is absent.
"""

from __future__ import annotations

from typing import Optional


def proc_status_kib(field_name: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmRSS``, ``VmHWM``), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (``VmHWM``) to its current RSS; False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakGrowth:
    """How much the block it wraps raised the peak memory of ``device``, in bytes (``.bytes``, ``.mib``; ``.how``
    says what was read).

    CUDA: ``torch.cuda.max_memory_allocated`` (reset on entry) minus what was allocated on entry. CPU: the peak
    RSS (``VmHWM``, reset on entry by :func:`reset_peak_rss`) minus the RSS on entry; where the reset is not
    supported, ``ru_maxrss`` (the process's whole-life peak: meaningful in a fresh process) minus the RSS.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.bytes = self.how = None

    @property
    def mib(self) -> float:
        return self.bytes / 2**20

    def __enter__(self) -> "PeakGrowth":
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._reset = reset_peak_rss()
            self._before = (proc_status_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(self, *exc) -> bool:
        import resource

        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._before
            self.how = "cuda max_memory_allocated - allocated before"
        elif self._reset:
            self.bytes = (proc_status_kib("VmHWM") or 0) * 1024 - self._before
            self.how = "VmHWM after clear_refs - VmRSS before (fresh process)"
        else:
            self.bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._before
            self.how = "ru_maxrss - VmRSS before (fresh process)"
        return False
