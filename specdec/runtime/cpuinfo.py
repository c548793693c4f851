"""What /proc/cpuinfo says about this CPU (its model name, its feature flags) and sysfs its caches,
read without starting a process (platform.processor() forks `uname -p`). Kernel choices and builds
are kept per CPU by these, and benchmark results name the CPU they ran on."""

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



CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def largest_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The size of this CPU's largest cache (sysfs `index*/size`, e.g. "32768K"), else None."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else None
