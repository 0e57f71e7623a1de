"""`python -m infra.watchers {gce,azure} [options] -- COMMAND...`: run COMMAND under a preemption
watcher (see `infra.watchers.supervisor`); exits with COMMAND's status."""

from __future__ import annotations

import argparse
import logging
import sys

from infra.watchers.azure_events import AZURE_IMDS_URL, IMDS_URL_ENV, AzureScheduledEventsWatcher, default_imds_url
from infra.watchers.gce_metadata import GCE_METADATA_URL, GcePreemptionWatcher, default_metadata_url
from infra.watchers.supervisor import Watcher, supervise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infra.watchers",
        usage="%(prog)s {gce,azure} [options] -- COMMAND [ARGS...]",
        description="Run COMMAND; on the cloud's preemption notice send it (and its children) SIGTERM.",
    )
    p.add_argument("cloud", choices=["gce", "azure"], help="whose notice to watch")
    p.add_argument(
        "--metadata-url",
        help=f"metadata service (default {GCE_METADATA_URL}, or http://$GCE_METADATA_HOST / {AZURE_IMDS_URL}, or ${IMDS_URL_ENV})",
    )
    p.add_argument("--instance", help="this VM's name (Azure: only its events count)")
    p.add_argument("--grace-s", type=float, default=25.0, help="drain time before SIGKILL (default 25)")
    p.add_argument("--poll-s", type=float, default=1.0, help="Azure: seconds between polls; GCE: retry delay")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = _parser().parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        _parser().error("give the command to run after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    watcher: Watcher
    if args.cloud == "gce":
        watcher = GcePreemptionWatcher(args.metadata_url or default_metadata_url(), retry_s=args.poll_s)
    else:
        watcher = AzureScheduledEventsWatcher(
            args.metadata_url or default_imds_url(), instance=args.instance, poll_s=args.poll_s
        )
    return supervise(command, watcher, grace_s=args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
