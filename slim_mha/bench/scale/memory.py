"""A scale case's memory: its peak above the baseline, and the cap on its address space (CPU)."""

from __future__ import annotations

import os
import resource

import torch

from ..._explicit_attention import available_bytes

__all__ = ["PeakMemory", "cap_address_space", "default_memory_cap"]


def cap_address_space(cap_bytes: int) -> None:
    """Let this process map at most ``cap_bytes`` more than it has mapped now."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + cap_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))


class PeakMemory:
    """Peak memory from here on, above what is in use now."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline: int | None = torch.cuda.memory_allocated(device)
            return
        self.baseline = _status_bytes("VmRSS")
        try:  # reset the high-water mark to the current resident size (Linux 4.0+)
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass

    def above_baseline(self) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - (self.baseline or 0)
        peak = _status_bytes("VmHWM")
        return None if peak is None or self.baseline is None else max(0, peak - self.baseline)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_memory_cap() -> int | None:
    """Half the memory available now (``MemAvailable``, cgroup and ``RLIMIT_AS`` headroom)."""
    available, _ = available_bytes(torch.device("cpu"))
    return None if available is None else available // 2
