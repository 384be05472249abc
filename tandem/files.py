"""Writing a file so that readers see the old one or the new one, never half of one.

Caches (the grammar compiler's tables, a target's tokenizer facts) and a distill run's records are
read by other processes while they are written, and a process may die mid-write: each write goes to
a temporary file beside the target, which then replaces it (a rename within one folder is atomic).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` (UTF-8) through a temporary file beside it, making the folder
    where needed. Raises OSError where the folder cannot take it, the temporary file removed."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):  # (never made, or not removable either)
            tmp.unlink()
        raise
