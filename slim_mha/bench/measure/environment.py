"""What a measurement ran on: the machine, torch, the allocator, the commit, the load."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

from ... import __version__
from .allocator import describe_allocator

__all__ = ["describe_environment", "load_average", "load_averages"]


def load_average() -> float | None:
    """The 1-minute load average; ``None`` where the system has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def load_averages() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, to two decimals; ``None`` where the system has none."""
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    """``HEAD``'s short hash, with ``+dirty`` when the package differs from it; ``None`` outside git."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", str(Path(__file__).resolve().parents[2]))
    dirty = changes is not None and bool(changes.stdout.strip())
    return head.stdout.strip() + ("+dirty" if dirty else "")


def describe_environment(device: torch.device) -> dict:
    environment = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "slim_mha": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device.type,
        "device_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "allocator": describe_allocator(),
    }
    if device.type == "cuda":
        environment.update(
            device_name=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
        )
    return environment
