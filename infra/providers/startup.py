"""The boot script of a cloud instance (GCE `startup-script`, Azure custom data).

`render_startup_script` writes a bash script that, in order: (1) runs `nvidia-smi` when the pool's
engine runs on CUDA (fail fast); (2) fetches the `BootPlan`'s files (the run's wheel and lock, e.g.
a CA) into `<install_dir>/boot/`, each checked against its sha256; (3) finds Python >= 3.11
(`bootstrap.python`, else `uv python install 3.11` where the image has uv) and, with `install:
wheel`, installs into `<install_dir>/venv` (`--system-site-packages`, reused) the lock unless the
venv holds it: from the run's wheelhouse with `--no-index` (an image's unpacked copy, else fetched;
every wheel checked against its manifest; a failure logs one line and falls back to the index),
then exactly the run's wheel `--no-deps` (`install: image` runs the baked-in venv as it is); (4)
unpacks the run's own modules (a user's reward or environment package) onto `PYTHONPATH`; (5) runs,
under its cloud's preemption watcher, a Prefect worker that polls only the instance's work queue
and exits when its one run ends. A failing step writes `rlboost boot failed on <instance>: <why>`
to the boot log and sets the instance's flow run Failed through the Prefect API. Values are
shell-quoted; the script carries no credentials. Detail: docs/cloud-pools.md, docs/internals.md §3.
"""

from __future__ import annotations

import shlex
from typing import Literal
from urllib.parse import unquote, urlsplit

from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.interface import BootFile, BootPlan, instance_work_queue
from infra.providers.pool import PoolSpec
from infra.services import prefect_worker
from rl import env_vars

WatcherKind = Literal["gce", "azure"]
MIN_PYTHON = (3, 11)
"""The oldest Python the project supports (pyproject's `requires-python`)."""
WHEEL_ENV = env_vars.WHEEL
"""A `BootFile.env`: the local path of the run's wheel on the VM."""
LOCK_ENV = env_vars.LOCK
WHEELHOUSE_ENV = env_vars.WHEELHOUSE
USER_CODE_ENV = env_vars.USER_CODE
"""A `BootFile.env`: the run's own modules outside the project (`infra.fleet.code_bundle.pack_user_code`)."""
"""A `BootFile.env`: the run's wheelhouse archive (`infra.fleet.wheelhouse`), fetched only when needed."""
MANIFEST = "SHA256SUMS"
"""A wheelhouse's manifest (`infra.fleet.wheelhouse`): one `<sha256>  <wheel file name>` line per
wheel, sorted by name (sha256sum's format, so the boot checks it with `sha256sum -c`)."""
LOCK_MARKER = ".rlboost-lock-sha256"
"""In the venv: the sha256 of the lock it holds (the boot, or an image recipe, writes it)."""
FLOW_RUN_ENV = env_vars.FLOW_RUN_ID
FAILED_PREFIX = "rlboost boot failed on"
"""How every boot-log line of a failed boot starts."""


def fetch_command(url: str, dest: str) -> str:
    """The shell command that copies `url` to the local path `dest` on a VM."""
    q = shlex.quote
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        return f"cp {q(unquote(parts.path) if parts.scheme else url)} {q(dest)}"
    if parts.scheme == "gs":
        return f"gcloud storage cp --quiet {q(url)} {q(dest)}"
    if parts.scheme == "s3":
        return f"aws s3 cp --only-show-errors {q(url)} {q(dest)}"
    if parts.scheme == "https" and (parts.hostname or "").endswith(".blob.core.windows.net"):
        return (
            "az login --identity --allow-no-subscriptions --output none && "
            f"az storage blob download --auth-mode login --no-progress --output none --blob-url {q(url)} --file {q(dest)}"
        )
    if parts.scheme in ("http", "https"):
        return f"curl -fsSL --retry 3 -o {q(dest)} {q(url)}"
    raise ValueError(
        f"a VM cannot fetch {url!r}: use a weight store on file://, gs://, s3:// or az:// (weights.store_url)"
    )


_FAILURE_FUNCTIONS = r"""
rlboost_log() { echo "rlboost boot: $*" >&2; }
rlboost_report() {
  [ -n "${FLOW_RUN_ENV:-}" ] && [ -n "${PREFECT_API_URL:-}" ] || return 0
  local text auth=()
  text=$(printf '%s' "$1" | tr -d '\000-\037' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')
  if [ -n "${PREFECT_API_KEY:-}" ]; then auth=(-H "Authorization: Bearer ${PREFECT_API_KEY}"); fi
  if [ -n "${PREFECT_API_AUTH_STRING:-}" ]; then auth=(-u "${PREFECT_API_AUTH_STRING}"); fi
  curl -fsS --max-time 20 --retry 2 -X POST -H 'Content-Type: application/json' "${auth[@]}" \
    -d "{\"state\": {\"type\": \"FAILED\", \"name\": \"Failed\", \"message\": \"${text}\"}, \"force\": true}" \
    "${PREFECT_API_URL%/}/flow_runs/${FLOW_RUN_ENV}/set_state" >/dev/null \
    || echo "rlboost boot: could not report the failure to flow run ${FLOW_RUN_ENV}" >&2
}
rlboost_fail() {
  trap - ERR
  local message="FAILED_PREFIX ${INSTANCE_ID_ENV}: $1"
  echo "$message" >&2
  rlboost_report "$message"
  exit 1
}
trap 'rlboost_fail "line $LINENO exited with status $?: $BASH_COMMAND"' ERR
rlboost_verify() {
  local actual
  actual=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$actual" = "$2" ] || { rm -f "$1"; rlboost_fail "$1 from $3 has sha256 $actual, not the $2 the run published: the store's copy is corrupt or was replaced; restart the run to upload it again"; }
}
rlboost_python_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (MIN_MAJOR, MIN_MINOR) else 1)' 2>/dev/null; }
"""
_FAILURE_FUNCTIONS = (
    _FAILURE_FUNCTIONS.replace("FAILED_PREFIX", FAILED_PREFIX)
    .replace("FLOW_RUN_ENV", FLOW_RUN_ENV)
    .replace("INSTANCE_ID_ENV", env_vars.INSTANCE_ID)
)


def render_startup_script(
    bootstrap: WorkerBootstrap,
    *,
    pool: PoolSpec,
    instance_id: str,
    run_id: str,
    watcher: WatcherKind,
    plan: BootPlan = BootPlan(),
) -> str:
    """The boot script of one instance of `pool`; `plan` adds its files, variables and GPU check."""
    q = shlex.quote
    root = bootstrap.install_dir.rstrip("/")
    venv, boot = f"{root}/venv", f"{root}/boot"
    envs = {f.env for f in plan.files if f.env}
    if bootstrap.install == "wheel" and not {WHEEL_ENV, LOCK_ENV} <= envs:
        raise ValueError(
            f"pool {pool.name}: `install: wheel` boots need the run's wheel and lock in the boot plan "
            f"({WHEEL_ENV}, {LOCK_ENV}); the training run ships them (infra.fleet.cloud_boot)"
        )
    env = {
        env_vars.RUN_ID: run_id,
        env_vars.POOL: pool.name,
        env_vars.INSTANCE_ID: instance_id,
        env_vars.CAPACITY_CLASS: pool.capacity_class,
        **plan.env,
    }
    if bootstrap.prefect_api_url is not None:
        env["PREFECT_API_URL"] = bootstrap.prefect_api_url
    lines = [
        "#!/bin/bash",
        f"# rlboost rollout instance {instance_id} of pool {pool.name}: fetch and verify its files, install "
        "the run's code, serve the pool's work queue.",
        "set -euo pipefail",
        'export HOME="${HOME:-/root}"',  # startup scripts may run without one; pip and uv want it
        *(f"export {key}={q(value)}" for key, value in env.items()),
        *_redis_ca_lines(bootstrap),
        # The work pool's flow-run command is `python -m prefect.engine`: the project's interpreter.
        f'export PATH={q(venv + "/bin")}:"$PATH"',
        _FAILURE_FUNCTIONS.replace("MIN_MAJOR", str(MIN_PYTHON[0])).replace("MIN_MINOR", str(MIN_PYTHON[1])).strip(),
        f"mkdir -p {q(boot)}",
    ]
    if plan.require_gpu:
        lines.append(
            "nvidia-smi -L >&2 || rlboost_fail "
            + q(
                f"pool {pool.name} runs its engine on cuda, but nvidia-smi fails: this VM has no working NVIDIA "
                "driver; use an image with the driver for its GPU (e.g. a Deep Learning VM image on GCP, an "
                "ubuntu-hpc or NVIDIA GPU-driver-extension image on Azure), or set the pool's device to cpu"
            )
        )
    wheelhouse = next((f for f in plan.files if f.env == WHEELHOUSE_ENV), None)
    for file in plan.files:
        if file is wheelhouse:
            continue  # fetched only when the venv does not hold the lock yet
        local = f"{boot}/{file.name}"
        part = f"{local}.part-{instance_id}"  # its own partial download; the rename is atomic
        lines += [
            f"if [ ! -f {q(local)} ] || [ \"$(sha256sum {q(local)} | cut -d' ' -f1)\" != {q(file.sha256)} ]; then",
            f"  {fetch_command(file.url, part)} || rlboost_fail {q(f'could not fetch {file.url}: check that the VM may read the weight store (its service account or managed identity)')}",
            f"  rlboost_verify {q(part)} {q(file.sha256)} {q(file.url)}",
            f"  mv {q(part)} {q(local)}",
            "fi",
            *([f"export {file.env}={q(local)}"] if file.env else []),
        ]
    lines += _venv_python(bootstrap, venv)
    if bootstrap.install == "wheel":
        lines += _install_lock_and_wheel(venv, root, wheelhouse, instance_id)
    watch = [
        f"{venv}/bin/python",
        "-m",
        "infra.watchers",
        watcher,
        *(["--instance", instance_id] if watcher == "azure" else []),
        "--grace-s",
        str(bootstrap.grace_s),
        "--",
        f"{venv}/bin/python",
        "-m",
        prefect_worker.__name__,
        "--pool",
        pool.name,
        "--work-queue",
        instance_work_queue(run_id, instance_id),
        "--name",
        instance_id,
        "--limit",
        "1",
        "--run-once",
    ]
    lines += _user_code_lines(plan, root)
    lines += [f"rlboost_log {q(f'starting the Prefect worker of {instance_id}')}", "trap - ERR"]
    lines.append("exec " + " ".join(q(part) for part in watch))
    return "\n".join(lines) + "\n"


def _venv_python(bootstrap: WorkerBootstrap, venv: str) -> list[str]:
    """Check the venv's Python (`install: wheel`: create the venv, with Python 3.11+ found or provided)."""
    q = shlex.quote
    need = f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
    venv_python = f"{venv}/bin/python"
    if bootstrap.install == "image":
        return [
            f"[ -x {q(venv_python)} ] || rlboost_fail "
            + q(f"install: image, but the image has no {venv}: bake the project into it, or use install: wheel"),
            f"rlboost_python_ok {q(venv_python)} || rlboost_fail "
            + q(f"{venv} runs an older Python than {need}: rebuild the image's venv"),
        ]
    return [
        f"if [ -x {q(venv_python)} ]; then",
        f"  rlboost_python_ok {q(venv_python)} || rlboost_fail "
        + q(f"{venv} exists but runs an older Python than {need}: remove it from the image"),
        "else",
        f"  PYTHON={q(bootstrap.python)}",
        '  if ! rlboost_python_ok "$PYTHON"; then',
        '    if command -v "$PYTHON" >/dev/null; then FOUND="$("$PYTHON" --version 2>&1 || true)"; else FOUND="no $PYTHON"; fi',
        "    if command -v uv >/dev/null; then",
        f'      rlboost_log "$FOUND is not Python {need} or newer: installing Python {need} with uv"',
        f"      uv python install {need} >&2",
        f"      PYTHON=$(uv python find {need})",
        "    else",
        f'      rlboost_fail "$FOUND on this image, and the project needs Python {need} or newer: use an image that '
        f'has it (fabric.cloud.bootstrap.python names it) or one with uv, which installs it"',
        "    fi",
        "  fi",
        f'  "$PYTHON" -m venv --system-site-packages {q(venv)}',
        "fi",
    ]


def _install_lock_and_wheel(venv: str, root: str, wheelhouse: BootFile | None, instance_id: str) -> list[str]:
    """Install the lock (from the wheelhouse with no index, else from the index) unless the venv
    holds it already, then the run's wheel unless it is the one installed."""
    q = shlex.quote
    pip = f"{q(venv + '/bin/python')} -m pip install --quiet --disable-pip-version-check --no-input"
    wheel_marker, lock_marker = f"{venv}/.rlboost-wheel-sha256", f"{venv}/{LOCK_MARKER}"
    from_index = (
        f'  {pip} -r "${LOCK_ENV}" || rlboost_fail "pip could not install the locked dependencies ($(basename '
        f'"${LOCK_ENV}")): check that the VM reaches the package index (PIP_INDEX_URL) or that the image has them"'
    )
    lines = [
        # One install at a time (GCE reruns startup scripts at every boot), and none twice.
        f"exec 9>{q(root + '/install.lock')}",
        "flock 9",
        f"LOCK_SHA=$(sha256sum \"${LOCK_ENV}\" | cut -d' ' -f1)",
        f'if [ "$(cat {q(lock_marker)} 2>/dev/null)" != "$LOCK_SHA" ]; then',
    ]
    if wheelhouse is None:
        lines += [
            "  rlboost_log 'no wheelhouse in this boot plan: installing the locked dependencies from the package index'",
            from_index,
        ]
    else:
        lines += [
            *("  " + line for line in _wheelhouse_function(wheelhouse, root, instance_id, pip)),
            "  if ! rlboost_wheelhouse; then",
            "  " + from_index,
            "  fi",
        ]
    lines += [
        f'  echo "$LOCK_SHA" > {q(lock_marker)}',
        "fi",
        f'if [ "$(cat {q(wheel_marker)} 2>/dev/null)" != "$(sha256sum "${WHEEL_ENV}" | cut -d\' \' -f1)" ]; then',
        f'  rlboost_log "installing $(basename "${WHEEL_ENV}") into {venv}"',
        f'  {pip} --no-deps --force-reinstall "${WHEEL_ENV}"',
        f"  sha256sum \"${WHEEL_ENV}\" | cut -d' ' -f1 > {q(wheel_marker)}",
        "fi",
        "exec 9>&-",
    ]
    return lines


def _wheelhouse_function(file: BootFile, root: str, instance_id: str, pip: str) -> list[str]:
    """`rlboost_wheelhouse`: unpack the wheelhouse (an image's copy, else the store's), check every
    wheel against its manifest and install the lock from it with no index; on any failure it logs
    one line saying why and returns 1 (the caller installs from the index)."""
    q = shlex.quote
    home, archive = f"{root}/wheelhouse/{file.sha256}", f"{root}/boot/{file.name}"
    instead = "installing the locked dependencies from the package index instead"
    lacks = f"the wheelhouse lacks a locked dependency for this VM (its Python or platform is not the training machine's): {instead}"
    # The failing wheels' lines ("<name>: FAILED"), on one line; the status is sha256sum's (pipefail).
    check = f"bad=$(cd \"$home\" && sha256sum --quiet --strict -c {MANIFEST} 2>/dev/null | tr '\\n' ' ')"
    return [
        "rlboost_wheelhouse() {",
        f"  local bad actual home={q(home)} archive={q(archive)} url={q(file.url)}",
        f'  local staging="$home.part-{instance_id}"',
        f'  if [ -f "$home/{MANIFEST}" ] && ! {check}; then',
        f'    rlboost_log "the wheelhouse in $home fails its {MANIFEST} (${{bad% }}): fetching it again from the store"',
        '    rm -rf "$home"',
        "  fi",
        f'  if [ ! -f "$home/{MANIFEST}" ]; then',
        f'    {fetch_command(file.url, archive)} || {{ rlboost_log "could not fetch the wheelhouse $url: {instead}"; return 1; }}',
        "    actual=$(sha256sum \"$archive\" | cut -d' ' -f1)",
        f'    if [ "$actual" != {file.sha256} ]; then',
        '      rm -f "$archive"',
        f'      rlboost_log "the wheelhouse $url has sha256 $actual, not the {file.sha256} the run published: {instead}"',
        "      return 1",
        "    fi",
        f'    export {WHEELHOUSE_ENV}="$archive"',
        '    rm -rf "$staging" && mkdir -p "$staging"',
        f'    tar -xf "$archive" -C "$staging" || {{ rlboost_log "could not unpack the wheelhouse $archive: {instead}"; return 1; }}',
        '    rm -f "$archive" && rm -rf "$home" && mv "$staging" "$home"',
        f"    if ! {check}; then",
        f'      rlboost_log "the wheelhouse $url fails its {MANIFEST} (${{bad% }}): {instead}"',
        '      rm -rf "$home"',
        "      return 1",
        "    fi",
        "  fi",
        '  rlboost_log "installing the locked dependencies from the wheelhouse $home, with no index"',
        f'  {pip} --no-index --find-links "$home" -r "${LOCK_ENV}" || {{ rlboost_log {q(lacks)}; return 1; }}',
        "}",
    ]


def _user_code_lines(plan: BootPlan, root: str) -> list[str]:
    """Unpack the run's own modules (once per archive) and put them on `PYTHONPATH`, which the
    Prefect worker's flow runs inherit."""
    file = next((f for f in plan.files if f.env == USER_CODE_ENV), None)
    if file is None:
        return []
    q = shlex.quote
    home = f"{root}/user-code/{file.sha256}"
    return [
        f"if [ ! -d {q(home)} ]; then",
        f"  rm -rf {q(home + '.part')} && mkdir -p {q(home + '.part')}",
        f'  tar -xzf "${USER_CODE_ENV}" -C {q(home + ".part")} || rlboost_fail '
        + q(f"could not unpack the run's own modules ({file.name})"),
        f"  mv {q(home + '.part')} {q(home)}",
        "fi",
        f'export PYTHONPATH={q(home)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
    ]


def _redis_ca_lines(bootstrap: WorkerBootstrap) -> list[str]:
    """Write the Redis CA (a public certificate, no secret) where the instance's worker finds it."""
    if bootstrap.redis_ca_pem is None:
        return []
    path = f"{bootstrap.install_dir.rstrip('/')}/redis-ca.pem"
    return [
        f"mkdir -p {shlex.quote(bootstrap.install_dir)}",
        f"printf '%s' {shlex.quote(bootstrap.redis_ca_pem)} > {shlex.quote(path)}",
        f"export {env_vars.REDIS_CA_FILE}={shlex.quote(path)}",
    ]
