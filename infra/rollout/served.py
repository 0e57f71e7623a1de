"""Which weights the fleet serves: from the registry's snapshots (each instance's version and the
sha of the weights it decodes with) and the publisher's sha per version (`TokenLog.expected_weights`),
how many instances serve each version and which serve bytes other than the publisher's. Pure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from infra.rollout.registry import InstanceSnapshot


@dataclass(frozen=True)
class ServedWeights:
    """What a set of instances serves."""

    versions: dict[str, int]
    """Instances per policy version they hold (``"none"``: not loaded yet), by version."""
    wrong: tuple[str, ...]
    """Instances whose weights sha differs from the publisher's for their version, sorted."""


def is_wrong(snapshot: InstanceSnapshot, expected: Mapping[int, str]) -> bool:
    """The instance reports a sha, the publisher recorded one for its version, and they differ."""
    version, sha = snapshot.policy_version, snapshot.weights_sha
    return version is not None and sha is not None and version in expected and expected[version] != sha


def served_weights(snapshots: Iterable[InstanceSnapshot], expected: Mapping[int, str]) -> ServedWeights:
    """How many of `snapshots` serve each version, and which serve the wrong bytes."""
    listed = list(snapshots)
    counts = Counter(s.policy_version for s in listed)
    versions = {
        "none" if v is None else str(v): counts[v] for v in sorted(counts, key=lambda v: -1 if v is None else v)
    }
    wrong = tuple(sorted(s.spec.instance_id for s in listed if is_wrong(s, expected)))
    return ServedWeights(versions=versions, wrong=wrong)
