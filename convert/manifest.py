"""The converter's bookkeeping on disk: the progress journal that makes a conversion resumable, and the
manifest (`hybrid.json`) that marks it finished.

The journal (`.hybrid-convert/progress.json`) records, after each output file is renamed into place, its size
and sha256 together with the key of the conversion (source fingerprint + options). A rerun with the same key
skips every recorded file that still has that size and checksum. The manifest is written last, after every
other file, so a directory with a manifest is complete; the journal is then removed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from hybrid.converted import MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION, read_manifest
from hybrid.safetensors_io import sha256_file, write_bytes_atomic

JOURNAL_DIR = ".hybrid-convert"
JOURNAL_FILE = "progress.json"

__all__ = ["MANIFEST_FILE", "MANIFEST_FORMAT", "MANIFEST_VERSION", "Journal", "read_manifest", "write_manifest",
           "source_fingerprint", "file_entry"]


def source_fingerprint(source: Path, shards: list[Path], small_files: list[Path], calib_file: Path | None) -> str:
    """Identifies the source without reading its weights: config.json's bytes, each shard's name, size and
    modification time, the bytes of the small files that are copied, the calibration text. A shard rewritten in
    place (new mtime) makes a different source, so a rerun converts it again instead of resuming."""
    digest = hashlib.sha256((source / "config.json").read_bytes())
    for path in sorted(shards):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    for path in small_files:
        digest.update(f"{path.name}\n".encode() + path.read_bytes())
    if calib_file is not None:
        digest.update(Path(calib_file).read_bytes())
    return digest.hexdigest()


def file_entry(directory: Path, rel: str) -> dict:
    path = directory / rel
    return {"path": rel, "size": path.stat().st_size, "sha256": sha256_file(path)}


class Journal:
    def __init__(self, dst: Path, key: dict):
        self.dir = dst / JOURNAL_DIR
        self.path = self.dir / JOURNAL_FILE
        self.key = key
        self.done: dict[str, dict] = {}

    def load(self) -> dict | None:
        """The recorded key of an earlier, unfinished conversion into DST (None if there was none)."""
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treat as a conversion with unknown options

    def resume(self, dst: Path) -> dict[str, dict]:
        """Entries of files that are still intact; anything else will be rewritten."""
        data = self.load() or {}
        intact = {}
        for rel, entry in (data.get("files") or {}).items():
            path = dst / rel
            if path.is_file() and path.stat().st_size == entry.get("size") and sha256_file(path) == entry.get(
                    "sha256"):
                intact[rel] = entry
        self.done = intact
        return intact

    def resume_from(self, dst: Path, entries: list[dict]) -> list[str]:
        """Seeds the journal from a finished manifest's entries; returns the files that failed their checksum
        (an empty list: everything is intact and nothing needs writing)."""
        self.dir.mkdir(exist_ok=True)
        self.done = {}
        self._save()
        damaged = []
        for entry in entries:
            path = dst / entry["path"]
            if path.is_file() and path.stat().st_size == entry.get("size") and sha256_file(path) == entry.get(
                    "sha256"):
                self.done[entry["path"]] = entry
            else:
                damaged.append(entry["path"])
        if damaged:
            self._save()
        else:
            self.remove()
        return damaged

    def record(self, entry: dict) -> None:
        self.done[entry["path"]] = entry
        self._save()

    def start(self) -> None:
        self.dir.mkdir(exist_ok=True)
        self._save()

    def _save(self) -> None:
        data = {"key": self.key, "files": self.done}
        write_bytes_atomic(self.path, json.dumps(data, indent=1).encode())

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def write_manifest(dst: Path, manifest: dict) -> None:
    write_bytes_atomic(dst / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
