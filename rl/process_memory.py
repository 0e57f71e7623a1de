"""The peak resident memory of this process, as the trainers report it with each step's metrics
(`peak_rss_mb`): the training process's own with the torch trainer, each rank's with DeepSpeed."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """This process's largest resident set so far, in MiB (getrusage's ru_maxrss: KiB on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)
