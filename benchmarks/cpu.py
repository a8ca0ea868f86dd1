"""The machine's CPU model, standard library only: the one home of what the benchmark records and the book's build
record (``tools/book``) call the machine."""
from __future__ import annotations

import platform
import re


def cpu_model() -> str:
    """The machine's CPU as ``/proc/cpuinfo`` names it (else what :mod:`platform` says).

    Returns:
        The model name, e.g. ``"Intel(R) Xeon(R) Processor"``.
    """
    try:
        with open("/proc/cpuinfo") as fh:
            found = re.search(r"^model name\s*:\s*(.+)$", fh.read(), re.M)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
