"""Multi-turn environments and user rewards (docs/environments.md): `protocol` is what an
environment implements, `registry` loads rewards and environments by name or import path (and
checks them when the configuration loads), `tool_calls` the tool-call formats (plain text, chat
templates), `calculator` the shipped tool environment. Torch-free: it runs in rollout instances."""
