"""The paper-scale simulator (docs/internals.md §11): RL steps on a reserved cluster plus spot
instances, driven by the runtime's own policies (`infra.rollout.policies`) over real spot traces.

Modules, one job each: `scenario` (the YAML scenario and its validation), `hardware` (the
roofline decode, prefill, training and weight-transfer model), `availability` (spot capacity from
traces), `events` (the event loop), `simulator` (one variant's run), `runner` (the variants side
by side), `report` (table and plot), `from_run` (a run recorded in the ledger as a scenario, and
its prediction: `rlboost cost --predict`).
"""
