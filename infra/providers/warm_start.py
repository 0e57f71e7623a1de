"""Warm starts of local instances: forked from a fork template (`rl.warm_fork`) that has imported
their modules (torch, transformers, the worker) once, instead of each new interpreter importing
them again (docs/internals.md §3).

A `LocalProvider` given a `WarmStart` forks each instance of a warm pool whose command is `python -m
<module> ...` of this interpreter from this process's template for the pool's preload and the
instance's environment less what names the instance (`INSTANCE_VARIABLES`) and what its run adds
(its Redis, its weights secret: those reach each instance as it forks); else, or when the template
failed, it starts the instance fresh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rl import env_vars
from rl.warm_fork.client import template_environment

INSTANCE_VARIABLES = frozenset({env_vars.INSTANCE_ID, env_vars.POOL, env_vars.CAPACITY_CLASS})
"""What differs between the instances of one template: who each one is."""


@dataclass(frozen=True)
class WarmStart:
    """Which pools' instances fork from a template, and what it imports before forking."""

    pools: frozenset[str]
    preload: tuple[str, ...]


def instance_template_environment(env: Mapping[str, str], run_environment: Iterable[str]) -> dict[str, str]:
    """The environment of the template an instance with environment `env` forks from: less the
    variables that name it and those its run adds (`run_environment`)."""
    return template_environment(env, INSTANCE_VARIABLES | set(run_environment))
