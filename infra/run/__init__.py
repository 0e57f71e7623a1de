"""One training run: its configuration (`config`), the in-process session the Prefect tasks drive
(`session`), the rollout fabric it uses when `fabric.enabled` (`fabric`, configured by
`fabric_config`), its per-step cost accounting (`accounting`, with the `workload` it records) and
its reports (`reporting`)."""
