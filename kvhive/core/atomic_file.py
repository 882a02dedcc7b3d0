"""Replacing a small file atomically, and removing the temp files a kill left behind (torch-free).

The session and response records and the disk tier's index snapshot are written this way: data to
``PATH.tmp``, fsync, rename over ``PATH``. A kill at any point leaves the old file or the new one;
a failed write (a full disk) removes its temp file and leaves the old file as it was.
"""

from __future__ import annotations

import contextlib
import os

TEMP_SUFFIX = ".tmp"


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` (temp file, fsync, rename); on OSError the temp file is
    removed and the error raised, the old file untouched."""
    tmp = f"{path}{TEMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_temp_files(directory: str) -> int:
    """Delete the temp files a kill left in ``directory`` (mid ``atomic_write``); how many."""
    removed = 0
    for name in os.listdir(directory):
        if name.endswith(TEMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed += 1
    return removed
