"""A content-addressed store of checkpoints: ``<root>/<name>/<version>/`` plus a ``manifest.json``.

Every write goes to a temporary folder beside its destination and is renamed into place, so a
reader never sees a half-written checkpoint and a failed write leaves the store as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dagster import ConfigurableResource, Failure
from pydantic import Field

from rlvr.files import write_atomically

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class StoredModel:
    name: str
    version: str
    path: Path
    manifest: dict

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


class ModelStore(ConfigurableResource):
    """Versioned, atomically written model folders."""

    root: str = Field(description="folder holding every stored model")

    def get(self, name: str, version: str) -> StoredModel | None:
        path = Path(self.root) / name / version
        manifest = path / MANIFEST
        if not manifest.is_file():
            return None
        return StoredModel(name, version, path, json.loads(manifest.read_text()))

    def versions(self, name: str) -> list[StoredModel]:
        """Every stored version of ``name``, oldest first (by the time its folder was renamed into place)."""
        parent = Path(self.root) / name
        folders = sorted((p for p in parent.iterdir() if (p / MANIFEST).is_file()), key=lambda p: p.stat().st_mtime) if parent.is_dir() else []
        return [stored for p in folders if (stored := self.get(name, p.name)) is not None]

    def latest(self, name: str) -> StoredModel | None:
        pointer = Path(self.root) / name / "LATEST"
        return self.get(name, pointer.read_text().strip()) if pointer.is_file() else None

    def require(self, name: str, version: str | None = None) -> StoredModel:
        """``get`` (or ``latest`` without a version), failing the step when the store does not hold it."""
        stored = self.latest(name) if version is None else self.get(name, version)
        if stored is None:
            what = name if version is None else f"{name} {version}"
            raise Failure(description=f"{what} is not in the model store: materialize {name} first")
        return stored

    def put(
        self,
        name: str,
        write: Callable[[Path], None],
        version: str | None = None,
        metadata: dict | None = None,
    ) -> StoredModel:
        """Run ``write(folder)`` into a temporary folder, then move it to ``<name>/<version>``.

        ``version`` defaults to the hash of the written files. If that version is already stored,
        the new copy is discarded: identical content, same version.
        """
        parent = Path(self.root) / name
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
        try:
            write(tmp)
            version = version or files_hash(tmp)[:16]
            manifest = {"name": name, "version": version, "files_sha256": files_hash(tmp), **(metadata or {})}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            final = parent / version
            if (final / MANIFEST).is_file():
                shutil.rmtree(tmp)
            else:
                if final.exists():  # leftover of an interrupted write without a manifest
                    shutil.rmtree(final)
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.set_latest(name, version)
        stored = self.get(name, version)
        assert stored is not None
        return stored

    def work_dir(self, name: str) -> Path:
        """A persistent scratch folder (e.g. a training run's resumable checkpoints), outside the versions."""
        path = Path(self.root) / ".work" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove_work_dir(self, name: str) -> None:
        """Delete a scratch folder once its work is complete (e.g. a finished run's resume points)."""
        shutil.rmtree(Path(self.root) / ".work" / name, ignore_errors=True)

    def set_latest(self, name: str, version: str) -> None:
        write_atomically(Path(self.root) / name / "LATEST", version)


def files_hash(folder: Path) -> str:
    """SHA-256 over the relative paths and bytes of every file below ``folder`` but the manifest."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest.update(str(path.relative_to(folder)).encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
