"""Warm forks: a template process imports a program's modules once, then forks each process of that
program from its warm state instead of a new interpreter importing them again (docs/internals.md §3).
Local rollout instances (`infra.providers.local`) and CPU trainer groups' torchrun agents
(`rl.distributed.group`) start so."""
