"""The run's wheelhouse for its cloud VMs: every dependency wheel of a pool's lock, in one archive.

- `build` runs `pip wheel -r <lock>` (the index pip is configured with; an sdist is built into a
  wheel) into `<cache>/wheelhouse/<digest>/`, keyed by the lock's text and this interpreter's
  version and platform, and writes `SHA256SUMS` (sha256sum's format) of its wheels; a cached one
  is checked against it first (`verify`: a corrupt wheel is one `WheelhouseError` line).
- `pack` writes the wheels and the manifest into one tar (kept beside them) with no times or
  owners, sorted: the same wheels give the same sha256, so `code_bundle.upload` keeps one copy
  under `<store>/code/<sha256>/` and a second run of the same lock uploads nothing.
A VM fetches it only when its venv does not hold the lock yet, checks the archive's sha256 and
every wheel against `SHA256SUMS`, and installs with `pip install --no-index --find-links`
(`infra.providers.startup`, which also says what a failed check falls back to).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from infra.fleet.code_bundle import sha256_of
from infra.providers.startup import MANIFEST


class WheelhouseError(RuntimeError):
    """The wheelhouse cannot be built, or a cached one does not match its manifest."""


def digest_of(lock_text: str) -> str:
    """The cache key of a lock's wheelhouse: its text and the interpreter and platform pip picks wheels for."""
    target = f"{sys.implementation.cache_tag} {sysconfig.get_platform()}\n"
    return hashlib.sha256((target + lock_text).encode()).hexdigest()


def verify(directory: Path) -> None:
    """Check every wheel of `directory` against its manifest (and that it holds no other wheel)."""
    manifest = directory / MANIFEST
    listed: dict[str, str] = {}
    for line in manifest.read_text().splitlines():
        sha, _, name = line.partition("  ")
        listed[name] = sha
    for name, sha in sorted(listed.items()):
        path = directory / name
        actual = sha256_of(path) if path.is_file() else "missing"
        if actual != sha:
            raise WheelhouseError(
                f"wheelhouse {directory}: {name} has sha256 {actual}, not the {sha} of its {MANIFEST}: "
                f"delete {directory} to build it again"
            )
    extra = sorted(p.name for p in directory.glob("*.whl") if p.name not in listed)
    if extra:
        raise WheelhouseError(
            f"wheelhouse {directory}: {', '.join(extra)} not in its {MANIFEST}: delete {directory} to build it again"
        )


def build(lock: Path, cache_dir: Path) -> Path:
    """The wheelhouse directory of `lock`: every wheel it needs, with their manifest (cached)."""
    target = cache_dir / "wheelhouse" / digest_of(lock.read_text())[:32]
    if (target / MANIFEST).is_file():
        verify(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch:
        out = Path(scratch) / "wheels"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-input"]
            + ["-r", str(lock), "-w", str(out)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-10:])
            raise WheelhouseError(f"pip wheel -r {lock.name} failed:\n{tail}")
        wheels = sorted(out.glob("*.whl"))
        (out / MANIFEST).write_text("".join(f"{sha256_of(w)}  {w.name}\n" for w in wheels))
        try:
            out.rename(target)
        except OSError:  # another run built the same lock first
            if not (target / MANIFEST).is_file():
                raise
    return target


def pack(directory: Path) -> Path:
    """The archive of a wheelhouse (kept in it): its manifest and wheels, byte-identical for the same wheels."""
    archive = directory / f"rlboost-wheelhouse-{directory.name[:16]}.tar"
    if archive.is_file():
        return archive
    names = [MANIFEST, *sorted(p.name for p in directory.glob("*.whl"))]
    part = archive.with_name(archive.name + ".part")
    with tarfile.open(part, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size, info.mode = (directory / name).stat().st_size, 0o644
            with (directory / name).open("rb") as f:
                tar.addfile(info, f)
    part.rename(archive)
    return archive
