"""Where llmu keeps files worth keeping between runs (not the KV cache: that is ``llmu.models.cache``).

One folder, in this order of preference:

1. ``$LLMU_CACHE``, when set (say, to a larger disk, or to a test's temporary folder);
2. ``$XDG_CACHE_HOME/llmu``, the Linux convention for caches;
3. ``~/.cache/llmu``.

Each user of the cache has a sub-folder of its own: ``models/`` holds the model's dequantized
weights (:mod:`llmu.models.weight_cache`), ``gpu-compile/`` the kernels ``llmu gpu-compile`` built.
Everything there can be deleted at any time; it is rebuilt when next needed.

This module imports nothing heavy (no torch), so ``llmu doctor`` can report on the cache even
where torch is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable that moves llmu's cache folder.
CACHE_ENV = "LLMU_CACHE"


def cache_dir(*parts: str) -> Path:
    """llmu's cache folder (``$LLMU_CACHE``, else ``$XDG_CACHE_HOME/llmu``, else ``~/.cache/llmu``),
    or the sub-folder ``parts`` of it. Read from the environment at each call; nothing is created."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        # the XDG specification says a relative XDG_CACHE_HOME is invalid and must be ignored
        base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
        root = base / "llmu"
    return Path(root).expanduser().joinpath(*parts)


def disk_usage(folder: str | Path) -> tuple[int, int]:
    """``(files, bytes)`` of the plain files under ``folder``; ``(0, 0)`` when it does not exist."""
    files = size = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            try:
                size += os.stat(os.path.join(dirpath, name), follow_symlinks=False).st_size
            except OSError:  # removed while we looked: another process cleaning up
                continue
            files += 1
    return files, size
