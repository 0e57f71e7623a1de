"""Embedded services a run uses in-process: Redis (`redis_embedded`), the Prefect API helpers
(`prefect_api`) and the Prefect defaults every entry point sets before Prefect loads
(`prefect_defaults`)."""
