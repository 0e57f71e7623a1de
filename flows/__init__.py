"""Prefect flows: `rl_train` (the training run) and `rollout_instance` (one rollout instance).
Importing this package sets the embedded-friendly Prefect defaults before Prefect is imported
(`infra.services.prefect_defaults`) and caps glibc's malloc arenas before the process starts its
threads (`rl.malloc_arenas`)."""

import infra.services.prefect_defaults  # noqa: F401
from rl.malloc_arenas import cap_malloc_arenas

cap_malloc_arenas()
