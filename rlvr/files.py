"""Files written whole or not at all: a reader, or a run resuming after a kill or a crash, sees the old
content or the new one, never a torn file."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def write_atomically(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (a str as UTF-8) to ``path`` through a hidden temporary file in the same folder,
    flushed to disk, then renamed over ``path``; the folder is synced so that the rename lasts too."""
    if not isinstance(data, (bytes, str)):
        raise TypeError(f"write_atomically writes bytes or str, got {type(data).__name__} for {path}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_tree(root: str | Path) -> None:
    """Flush every file and folder under ``root`` to disk (before renaming it into place)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(folder)


def fsync_dir(folder: str | Path) -> None:
    """Flush ``folder``'s entries (a file created or renamed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
