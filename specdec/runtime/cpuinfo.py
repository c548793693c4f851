"""What /proc/cpuinfo says about this CPU (its model name, its feature flags), read without
starting a process (platform.processor() forks `uname -p`). Kernel choices and builds are kept per
CPU by these, and benchmark results name the CPU they ran on."""

from __future__ import annotations

from pathlib import Path


def cpuinfo_field(name: str) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo, else None (no file or field)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() == name:
            return value.strip()
    return None

