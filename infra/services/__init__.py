"""Services a run uses: Redis (`redis_embedded`), the Prefect API helpers (`prefect_api`), the
Prefect defaults every entry point sets before Prefect loads (`prefect_defaults`), and the Prefect
process worker that serves a pool's flow runs (`prefect_worker`, a process of its own: the stack,
the local Prefect instances and a cloud VM's boot script start it by its module's `__name__`, so
the import contracts see who starts it)."""
