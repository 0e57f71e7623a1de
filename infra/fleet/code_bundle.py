"""The run's own code for its cloud VMs: one wheel, a lock of its dependencies, both in the store.

- `build_wheel` builds the project's wheel from its source checkout (`pip wheel --no-deps
  --no-build-isolation`: offline), in a copy of the files that go into it, cached by their
  content under `~/.cache/rlboost/wheels/<digest>/` (`RLBOOST_WHEEL_CACHE`).
- `lock_requirements` pins the wheel's requirements (with a pool's extras), and theirs, to the
  versions installed here, from this environment's metadata (no resolver, no index); local labels
  are dropped (`torch==2.13.0`, not `+cpu`), and a requirement not installed here (a GPU pool's
  `vllm` on a CPU trainer) stays as the wheel declares it, the lock saying so.
- `pack_user_code` packs the run's own modules outside the project (a user's reward or
  environment package, `infra.run.user_code`) into one archive the VMs unpack onto `PYTHONPATH`.
- `upload` puts a file under `<store>/code/<sha256>/<name>` (content-addressed: an existing copy
  of the same size is kept) and returns the `BootFile` a VM fetches and verifies.
How a VM uses them: docs/cloud-pools.md ("What happens during a run"), docs/internals.md §3.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from email.parser import Parser
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from infra.providers.interface import BootFile
from rl import env_vars

PROJECT = "rlboost"
CACHE_ENV = env_vars.WHEEL_CACHE
SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "setup.cfg", "setup.py")
"""Top-level files of the checkout that a build reads, when present."""
SKIPPED_PARTS = frozenset({"__pycache__", ".pytest_cache", ".ruff_cache"})


class CodeBundleError(RuntimeError):
    """The run cannot ship its code: no source checkout and no wheel given, or a failed build."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_root() -> Path | None:
    """The source checkout this code runs from (the directory whose pyproject.toml names the
    project, above the `infra` package), or None when it is installed from a wheel."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and f'name = "{PROJECT}"' in pyproject.read_text():
        return root
    return None


def source_files(root: Path) -> list[Path]:
    """The files of the checkout that go into the wheel, relative to `root`, sorted."""
    packages = _packages(root)
    found = [Path(name) for name in SOURCE_FILES if (root / name).is_file()]
    for package in packages:
        for path in (root / package).rglob("*"):
            relative = path.relative_to(root)
            if path.is_file() and not SKIPPED_PARTS & set(relative.parts) and path.suffix not in (".pyc", ".pyo"):
                found.append(relative)
    return sorted(found)


def _packages(root: Path) -> list[str]:
    """Top-level package directories (those `[tool.setuptools.packages.find] include` names)."""
    import tomllib

    config = tomllib.loads((root / "pyproject.toml").read_text())
    include = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("include", [])
    stems = sorted({pattern.rstrip("*").split(".")[0] for pattern in include})
    return [stem for stem in stems if (root / stem / "__init__.py").is_file()]


def source_digest(root: Path, files: Iterable[Path]) -> str:
    """sha256 over the names and contents of `files`: the cache key of their wheel."""
    digest = hashlib.sha256()
    for relative in files:
        digest.update(str(relative).encode() + b"\0")
        digest.update(sha256_of(root / relative).encode() + b"\n")
    return digest.hexdigest()


def wheel_cache() -> Path:
    """Where built wheels (and `infra.fleet.wheelhouse`'s wheelhouses) are kept."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / PROJECT / "wheels")


def build_wheel(root: Path | None = None, cache_dir: Path | None = None) -> Path:
    """The project's wheel built from `root` (default: `source_root()`), from the cache when the
    same sources were built before."""
    root = root or source_root()
    if root is None:
        raise CodeBundleError(
            f"cloud VMs install the run's own wheel, built from its source checkout, but this {PROJECT} is "
            f"installed without one ({Path(__file__).resolve().parents[2]}): build a wheel of the same code "
            "(`pip wheel --no-deps .` in the checkout) and set fabric.cloud.bootstrap.wheel to its path"
        )
    files = source_files(root)
    cache = cache_dir or wheel_cache()
    target = cache / source_digest(root, files)[:32]
    built = sorted(target.glob("*.whl")) if target.is_dir() else []
    if built:
        return built[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=cache) as scratch:
        tree, out = Path(scratch) / "src", Path(scratch) / "wheel"
        for relative in files:
            (tree / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / relative, tree / relative)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out)]
            + ["--disable-pip-version-check", "--no-input", str(tree)],
            capture_output=True,
            text=True,
        )
        wheels = sorted(out.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise CodeBundleError(f"building the {PROJECT} wheel from {root} failed (pip wheel):\n{tail}")
        staged = Path(scratch) / "staged"
        staged.mkdir()
        shutil.move(wheels[0], staged / wheels[0].name)
        try:
            staged.rename(target)
        except OSError:  # another run built the same sources first
            if not any(target.glob("*.whl")):
                raise
    return sorted(target.glob("*.whl"))[0]


def wheel_requirements(wheel: Path) -> list[str]:
    """The `Requires-Dist` lines of a wheel's metadata."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(name).decode())
    return meta.get_all("Requires-Dist") or []


def lock_requirements(wheel: Path, extras: Iterable[str]) -> str:
    """A requirements file pinning the wheel's dependencies (with `extras`) to this environment's
    versions; deterministic for the same wheel, extras and environment."""
    extras = sorted(set(extras))
    pins: dict[str, str] = {}
    unpinned: dict[str, str] = {}
    queue = [(Requirement(line), set(extras)) for line in wheel_requirements(wheel)]
    queue = [(req, chosen) for req, chosen in queue if _applies(req, chosen)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while queue:
        requirement, _ = queue.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen or name == PROJECT:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            unpinned.setdefault(name, str(requirement).split(";")[0].strip())
            continue
        version = Version(dist.version)
        if not requirement.specifier.contains(version, prereleases=True):
            unpinned.setdefault(name, str(requirement).split(";")[0].strip())
            continue
        pins[name] = f"{name}=={version.public}"
        for line in dist.requires or []:
            child = Requirement(line)
            if _applies(child, set(requirement.extras)):
                queue.append((child, set(child.extras)))
    for name in pins:
        unpinned.pop(name, None)
    header = [
        f"# Dependencies of {wheel.name} with extras [{','.join(extras)}], pinned to the versions of the training",
        "# run's environment (local build labels such as +cpu dropped). Generated by infra.fleet.code_bundle.",
    ]
    if unpinned:
        header.append("# Not installed in the training run's environment, so as the wheel declares them:")
    return "\n".join(header + sorted(unpinned.values()) + sorted(pins.values())) + "\n"


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    """Whether `requirement` is needed here with `extras` (its marker, evaluated for this platform)."""
    if requirement.marker is None:
        return True
    if any(requirement.marker.evaluate({"extra": extra}) for extra in extras):
        return True
    return requirement.marker.evaluate({"extra": ""})


def pack_user_code(modules: Mapping[str, Path], scratch: Path) -> Path:
    """`modules` (top-level name -> package directory or `.py` file) in `<scratch>/user-code.tar.gz`,
    each under its own name at the archive's root, byte for byte the same for the same files
    (sorted, no times or owners: the same code uploads once)."""
    scratch.mkdir(parents=True, exist_ok=True)
    target = scratch / "user-code.tar.gz"
    members: list[tuple[str, Path]] = []
    for name, source in sorted(modules.items()):
        if source.is_dir():
            files = (p for p in source.rglob("*") if p.is_file() and not SKIPPED_PARTS & set(p.parts))
            members += [(f"{name}/{p.relative_to(source).as_posix()}", p) for p in files if p.suffix != ".pyc"]
        else:
            members.append((f"{name}{source.suffix}", source))
    with (
        open(target, "wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as packed,
        tarfile.open(fileobj=packed, mode="w", format=tarfile.PAX_FORMAT) as archive,
    ):
        for arcname, path in sorted(members):
            info = tarfile.TarInfo(arcname)
            info.size, info.mode = path.stat().st_size, 0o644
            with path.open("rb") as content:
                archive.addfile(info, content)
    return target


def vm_url(url: str, options: Mapping[str, Any] | None = None) -> str:
    """The URL a VM fetches a store object from: an `az://` / `abfs://` path becomes its blob URL
    (`https://<account_name>.blob.core.windows.net/...`, the account from the store options)."""
    parts = urlsplit(url)
    if parts.scheme in ("az", "abfs", "abfss"):
        account = (options or {}).get("account_name")
        if not account:
            raise CodeBundleError(
                f"the VMs fetch {url} with the Azure CLI, which needs the storage account: set "
                "account_name in weights.store_options"
            )
        return f"https://{account}.blob.core.windows.net/{parts.netloc}{parts.path}"
    return url


def upload(path: Path, store_url: str, options: Mapping[str, Any] | None, env: str | None = None) -> BootFile:
    """Copy `path` to `<store_url>/code/<sha256>/<name>` (kept if already there) for the VMs."""
    sha = sha256_of(path)
    url = f"{store_url.rstrip('/')}/code/{sha}/{path.name}"
    fs, remote = fsspec.core.url_to_fs(url, **dict(options or {}))
    if not (fs.exists(remote) and fs.size(remote) == path.stat().st_size):
        fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), remote + ".part")
        fs.mv(remote + ".part", remote)
    return BootFile(path.name, vm_url(url, options), sha, env)
