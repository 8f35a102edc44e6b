"""Atomic writes of what a user keeps: files, and directories (heads, adapters, dataset shards).

A file is written to a temporary file beside it, then renamed over it. A directory's new content
is assembled in a staging directory beside the destination and renamed into place, so a reader
sees the old directory or the new one, never a mix; if the swap fails, the old one is put back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def staging_dir_for(path: Path) -> Path:
    """A fresh private directory beside ``path`` (same filesystem, so the rename is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))


def replace_dir(staging: Path, path: Path) -> None:
    """Move ``staging`` to ``path``, replacing what was there; the old one survives a failure.

    mkdtemp made ``staging`` private; what a user keeps gets ordinary permissions (rwxr-xr-x for
    the directory, rw-r--r-- for the files in it).
    """
    staging.chmod(0o755)
    for item in staging.iterdir():
        if item.is_file():
            item.chmod(0o644)
    if not path.exists():
        os.rename(staging, path)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
    try:
        os.rename(path, retired / "old")
        try:
            os.rename(staging, path)
        except BaseException:
            os.rename(retired / "old", path)  # put the old directory back
            raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)


def write_file_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """Have ``write`` fill a temporary file beside ``path``, then rename it over ``path``:
    readers see the old file or the new one, never a part. The temporary file keeps ``path``'s
    suffix (writers such as matplotlib choose the format by it) and gets rw-r--r--."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent
    )
    os.close(handle)
    try:
        write(Path(temporary))
        os.chmod(temporary, 0o644)  # mkstemp made it private; what a user keeps is not
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` so that readers see the old file or the new one."""
    return write_file_atomic(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
