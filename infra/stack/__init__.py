"""The local service stack of `rlboost up` / `rlboost down` (`stack`): detached service processes
(`processes`) and the Prefect process worker that serves a pool's runs (`prefect_worker`)."""
