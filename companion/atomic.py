"""Atomic file writing, the one way every file of the companion and its build tools is written.

Standard library only, so that the book's build steps (``tools/book``, loaded when Snakemake parses the workflow,
before any job) use it without importing torch.
"""
from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (``str``: UTF-8) to ``path`` atomically, the one way every file of the companion is written.

    A temporary ``.NAME.tmp-PID`` in the same folder (created with its parents), fsync, read back and compared, then
    ``os.replace``: an interrupted write leaves the previous version intact, a short write is never installed, and
    a temporary left by a killed writer is recognised (:func:`remove_stale_temporaries`).

    Args:
        path: the file to (re)write.
        data: its new content.

    Raises:
        OSError: the write failed or the bytes read back differ (``path`` left as it was).
    """
    if isinstance(data, str):
        data = data.encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp, "rb") as f:  # verify what reached the disk before it replaces the previous version
            if f.read() != data:
                raise OSError(f"{tmp}: the bytes read back differ from the bytes written; {path} left as it was")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
