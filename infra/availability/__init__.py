"""How capacity comes and goes: the capacity classes of instances and the availability traces
(recorded, shipped under `infra/data/traces`) or Poisson schedules that preempt local pools."""
