"""Memory this process may still use on a device.

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["available_memory_bytes"]


def available_memory_bytes(device: torch.device | str) -> int:
    """Bytes this process may still allocate on ``device``.

    - CUDA: free memory from ``torch.cuda.mem_get_info`` (other processes' use is subtracted).
    - Anything else (host memory): ``MemAvailable`` from ``/proc/meminfo`` (Linux: free plus
      reclaimable page cache), capped by the cgroup v2 limit minus usage when this process runs
      in a memory-limited container (``/sys/fs/cgroup/memory.max``), since an edge device's
      container limit, not the host's RAM, is what the job may use. Without ``/proc/meminfo``
      (macOS, Windows) falls back to ``os.sysconf`` available pages, then total pages; psutil is
      not required. Raises ``RuntimeError`` if none of these exist.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    available = _meminfo_available_bytes()
    if available is None:
        available = _sysconf_bytes()
    if available is None:
        raise RuntimeError(
            f"available_memory_bytes({device}): cannot read host memory (no /proc/meminfo, no "
            "os.sysconf page counts); declare memory_bytes in a hand-written ClusterProfile"
        )
    limit = _cgroup_free_bytes()
    return available if limit is None else min(available, limit)


def _meminfo_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes "kB" for KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sysconf_bytes() -> int | None:
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return int(os.sysconf(pages)) * int(os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            continue
    return None


def _cgroup_free_bytes() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        return max(int(limit) - int(used), 0)
    except (OSError, ValueError):
        return None
