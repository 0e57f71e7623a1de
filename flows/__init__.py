"""Prefect flows: `rl_train` (the training run) and `rollout_instance` (one rollout instance).
Importing this package sets the embedded-friendly Prefect defaults before Prefect is imported
(`infra.services.prefect_defaults`)."""

import infra.services.prefect_defaults  # noqa: F401
