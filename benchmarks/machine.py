"""The machine a benchmark ran on, as its printout names it (imported by the scripts beside it)."""

import os
import platform
from pathlib import Path


def cpu_name(isa=False):
    """The CPU's model name from ``/proc/cpuinfo`` (else what ``platform`` knows).

    Args:
        isa: append the widest x86 vector extension (AVX-512 / AVX2) and the logical CPU count.

    >>> isinstance(cpu_name(), str)
    True
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                None) or platform.processor() or platform.machine()
    if not isa:
        return name
    widest = next((ext for ext in ("avx512f", "avx2") if f" {ext}" in info), "no avx2")
    return f"{name} ({widest}, {os.cpu_count()} logical CPUs)"
