"""How much memory a new allocation on a device can get: the memory guard's one probe.

On CPU, the smallest of the address space left under ``RLIMIT_AS``, the headroom under the cgroup's
memory limit (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, reclaimable file cache counted as
free) and the kernel's ``MemAvailable`` plus free swap (``CommitLimit - Committed_AS`` under strict
overcommit); on CUDA, the device's free memory plus what the caching allocator holds unused.
Anything it cannot read counts as unlimited: an unknown limit never refuses a call.

Read only for requests large enough that the reads cost nothing beside them
(:mod:`slim_mha._explicit_attention`'s guard), and by the scale sweep for its default cap.
"""

from __future__ import annotations

import os

import torch

__all__ = ["available_bytes"]

_UNLIMITED_CGROUP = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def available_bytes(device: torch.device) -> tuple[int | None, str]:
    """The most memory a new allocation on ``device`` can get, and what limits it (``None``: unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"free memory on {device}"
    if device.type != "cpu":
        return None, "unknown"
    limits = [
        (_address_space_left(), "the address space left under RLIMIT_AS"),
        (_cgroup_headroom(), "the headroom under the cgroup memory limit"),
        (_system_available(), "MemAvailable in /proc/meminfo"),
    ]
    known = [limit for limit in limits if limit[0] is not None]
    return min(known) if known else (None, "unknown")


def _address_space_left() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as statm:
            return soft - int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError):
        return None


def _read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes, by field name."""
    fields = {}
    with open(path) as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def _system_available(
    meminfo_path: str = "/proc/meminfo", overcommit_path: str = "/proc/sys/vm/overcommit_memory"
) -> int | None:
    try:
        fields = _read_meminfo(meminfo_path)
        with open(overcommit_path) as overcommit:
            strict = overcommit.read().strip() == "2"
    except (OSError, ValueError):
        return None
    if strict and "CommitLimit" in fields and "Committed_AS" in fields:
        return fields["CommitLimit"] - fields["Committed_AS"]
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def _cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Least ``limit - usage + file cache`` over this process's memory cgroup and its ancestors.

    Usage counts the page cache, and the kernel reclaims all of it, active and inactive, before it
    refuses an allocation, so both lists count as headroom (shared memory is not on them).
    """
    try:
        with open(proc_cgroup) as cgroups:
            lines = cgroups.read().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            base, files = root, ("memory.max", "memory.current", ("active_file", "inactive_file"))
        elif "memory" in controllers.split(","):  # v1
            base, files = (
                os.path.join(root, "memory"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
            )
        else:
            continue
        headrooms += _headrooms_along(base, path, *files)
    return min(headrooms) if headrooms else None


def _headrooms_along(base: str, path: str, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> list[int]:
    """Headroom of every cgroup directory from ``base/path`` up to ``base`` that sets a limit.

    Inside a cgroup namespace ``path`` may not exist under ``base`` (``base`` is then the process's
    own cgroup), so missing directories are skipped.
    """
    parts = [part for part in path.split("/") if part]
    headrooms = []
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(base, *parts[:depth])
        try:
            with open(os.path.join(directory, limit_file)) as file:
                text = file.read().strip()
            if text == "max" or int(text) >= _UNLIMITED_CGROUP:
                continue
            with open(os.path.join(directory, usage_file)) as file:
                usage = int(file.read())
        except (OSError, ValueError):
            continue
        stat = os.path.join(directory, "memory.stat")
        headrooms.append(int(text) - usage + sum(_stat_field(stat, key) for key in cache_keys))
    return headrooms


def _stat_field(path: str, key: str) -> int:
    try:
        with open(path) as stat:
            for line in stat:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
