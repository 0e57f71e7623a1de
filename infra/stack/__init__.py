"""The local service stack of `rlboost up` / `rlboost down` (`stack`) and its detached service
processes (`processes`); the Prefect process worker it starts is `infra.services.prefect_worker`."""
