"""The rollout plane: the Redis protocol of a run (`protocol`), the token log and the instance
registry over it, the rollout worker and its settings, the controller that rolls out each step,
and the pure decision functions it calls (`policies`)."""
