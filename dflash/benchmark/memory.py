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
