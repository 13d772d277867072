"""Keeps numba's on-disk cache of the CPU kernels consistent with their sources.

numba keys each cached function by its own source file (path, modification time, size) and nothing else. A cached
function that inlines or calls kernels of another module keeps the old machine code after only that other module
changed: after an edit to `kernels_vnni_int4` alone, `decode_pool`'s cached `_serve` still ran the previous int4
loop and disagreed with the operator. A fresh install rewrites every file, so it is safe; an editable install
updated by `git pull`, or a developer's tree, is not. `refresh` drops the package's cache whenever any of its
sources changed since the cache was written (one hash over every module, kept in a stamp file beside the cache),
so the kernels are compiled again from what is on disk. Call it before the first kernel of a process runs: numba
reads a cache file when a function is first called, not at import.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
STAMP_NAME = "numba-sources.blake2b"


def sources_digest(package_dir: Path = PACKAGE_DIR) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(package_dir.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def refresh(package_dir: Path = PACKAGE_DIR) -> bool:
    """Removes the package's numba cache files if its sources changed since they were written; True if it did.
    A cache directory that cannot be written (a read-only install: numba then caches elsewhere) is left alone."""
    cache_dir = package_dir / "__pycache__"
    stamp = cache_dir / STAMP_NAME
    digest = sources_digest(package_dir)
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass  # no stamp yet: whatever cache is there has no known sources
    try:
        cache_dir.mkdir(exist_ok=True)
        for path in list(cache_dir.glob("*.nbi")) + list(cache_dir.glob("*.nbc")):
            path.unlink(missing_ok=True)
        partial = stamp.with_name(f"{STAMP_NAME}.{os.getpid()}")
        partial.write_text(digest)
        partial.replace(stamp)  # atomic: a concurrent start sees the old stamp or the new one
    except OSError:
        return False
    return True
