"""`WeightStore`: the run's durable copy of each policy version, through fsspec.

Layout under the store URL (`file://`, `s3://`, `gs://`, `az://`, ...):

    <store>/weights/v<version>/chunk-00000.safetensors
    <store>/weights/v<version>/...
    <store>/weights/v<version>/manifest.json

`write` uploads every chunk first and the manifest last (to a temporary name, then moved), so a
version is *complete*, and visible to readers, exactly when its manifest exists. `delete` removes
the manifest first, so a version being deleted is never mistaken for a complete one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import fsspec

from infra.weights.manifest import MANIFEST_FILE, EncodedVersion, Manifest

_VERSION_DIR = re.compile(r"^v(\d+)$")


class WeightStore:
    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **dict(options or {}))
        self.root = root.rstrip("/")

    def version_dir(self, version: int) -> str:
        return f"{self.root}/weights/v{version}"

    def _path(self, version: int, name: str) -> str:
        return f"{self.version_dir(version)}/{name}"

    def write(self, encoded: EncodedVersion) -> None:
        """Upload all chunks, then the manifest (the version becomes visible last)."""
        directory = self.version_dir(encoded.version)
        self.fs.makedirs(directory, exist_ok=True)
        for info, data in zip(encoded.manifest.chunks, encoded.chunks, strict=True):
            self.fs.pipe_file(self._path(encoded.version, info.file), data)
        staging = self._path(encoded.version, f".{MANIFEST_FILE}.partial")
        self.fs.pipe_file(staging, encoded.manifest_bytes)
        self.fs.mv(staging, self._path(encoded.version, MANIFEST_FILE))

    def versions(self) -> dict[int, bool]:
        """Every version with anything in the store, mapped to whether it is complete."""
        self.fs.invalidate_cache()
        base = f"{self.root}/weights"
        if not self.fs.exists(base):
            return {}
        found: dict[int, bool] = {}
        for entry in self.fs.ls(base, detail=False):
            match = _VERSION_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if match:
                found[int(match.group(1))] = False
        for path in self.fs.glob(f"{base}/v*/{MANIFEST_FILE}"):
            match = _VERSION_DIR.match(path.rstrip("/").rsplit("/", 2)[-2])
            if match:
                found[int(match.group(1))] = True
        return found

    def complete_versions(self) -> list[int]:
        return sorted(v for v, complete in self.versions().items() if complete)

    def read_manifest_bytes(self, version: int) -> bytes:
        """FileNotFoundError while the version is incomplete or absent."""
        return self.fs.cat_file(self._path(version, MANIFEST_FILE))

    def read_manifest(self, version: int) -> Manifest:
        return Manifest.from_bytes(self.read_manifest_bytes(version))

    def read_chunk(self, version: int, file: str) -> bytes:
        return self.fs.cat_file(self._path(version, file))

    def delete(self, version: int) -> None:
        """Remove a version: its manifest first (it stops being complete), then the rest."""
        manifest = self._path(version, MANIFEST_FILE)
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        directory = self.version_dir(version)
        if self.fs.exists(directory):
            self.fs.rm(directory, recursive=True)
        self.fs.invalidate_cache()
