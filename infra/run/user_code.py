"""A run's own code outside the project: the packages its `reward.function` and `environment.class`
import from, and how they reach the rollout instances.

`user_code(config)` maps each such top-level module to its source (a package directory or a
module file), as the training process imported it when the configuration loaded. Left out: the
project's own packages, the standard library and installed distributions (site-packages), which the
instances have as the training process has them. Local instances get the modules' directories
on `PYTHONPATH` (`python_path`); cloud VMs get the modules themselves in the run's code bundle
(`infra.fleet.code_bundle.pack_user_code`), unpacked onto theirs. docs/environments.md, "Your own
package on the rollout instances".
"""

from __future__ import annotations

import importlib.util
import os
import site
import sysconfig
from collections.abc import Iterable, Mapping
from pathlib import Path

from infra.run.config import RunConfig

PROJECT_PACKAGES = frozenset({"rl", "infra", "flows", "tasks"})
"""The project's top-level packages (pyproject's `packages.find`): every instance has them."""


def import_paths(config: RunConfig) -> list[str]:
    """The run's import paths of user code: `reward.function`, `environment.class`."""
    environment = config.environment
    paths = [config.reward.function, environment.class_ if environment is not None else None]
    return [path for path in paths if path is not None]


def _installed_roots() -> list[Path]:
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return [Path(root).resolve() for root in roots]


def modules_of(paths: Iterable[str]) -> dict[str, Path]:
    """Top-level module name -> its source (package directory or `.py` file) for each import path
    of code outside the project and outside installed distributions; call after the paths were
    checked (`rl.environments.registry`), so each module imports."""
    installed = _installed_roots()
    found: dict[str, Path] = {}
    for path in paths:
        top = path.partition(":")[0].split(".")[0]
        if top in PROJECT_PACKAGES or top in found:
            continue
        spec = importlib.util.find_spec(top)
        if spec is None:
            continue
        if spec.submodule_search_locations:
            source = Path(next(iter(spec.submodule_search_locations))).resolve()
        elif spec.origin is not None and spec.origin.endswith(".py"):
            source = Path(spec.origin).resolve()
        else:  # a built-in or compiled module: nothing to ship
            continue
        if any(source.is_relative_to(root) for root in installed):
            continue
        found[top] = source
    return dict(sorted(found.items()))


def user_code(config: RunConfig) -> dict[str, Path]:
    """The run's user modules (see `modules_of`)."""
    return modules_of(import_paths(config))


def python_path(modules: Mapping[str, Path], inherited: str | None = None) -> str | None:
    """`PYTHONPATH` for a local instance: the directories holding `modules`, then `inherited` (this
    process's); None when there is nothing to add."""
    directories = list(dict.fromkeys(str(source.parent) for source in modules.values()))
    if not directories:
        return None
    return os.pathsep.join([*directories, *([inherited] if inherited else [])])
