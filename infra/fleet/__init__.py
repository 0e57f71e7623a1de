"""Keeping instances running: the capacity manager and cloud fleet that hold cloud pools at
target, and the Prefect-backed instances (one `rollout-instance` flow run per instance) used by
cloud VMs and by local pools with `fabric.instances: prefect`. Nothing here imports the fabric."""
