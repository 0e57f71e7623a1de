"""In-VM preemption watchers: the cloud's notice becomes the rollout worker's SIGTERM drain.

`gce_metadata` (the GCE metadata server's `instance/preempted`), `azure_events` (Azure Scheduled
Events `Preempt`), `supervisor` (runs the worker command and signals it), `__main__`
(`python -m infra.watchers gce|azure -- COMMAND`).
"""

from infra.watchers.azure_events import AzureScheduledEventsWatcher
from infra.watchers.gce_metadata import GcePreemptionWatcher
from infra.watchers.supervisor import PreemptionNotice, Watcher, supervise

__all__ = ["AzureScheduledEventsWatcher", "GcePreemptionWatcher", "PreemptionNotice", "Watcher", "supervise"]
