"""What the benchmarks say about the machine they ran on (results are machine dependent)."""

from __future__ import annotations

import platform

from specdec.runtime.cpuinfo import cpuinfo_field


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (e.g. "AMD EPYC …"), else what platform knows."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"
