#!/bin/bash
# Bake a run's wheelhouse into a VM image (a Packer `shell` provisioner, a Dockerfile RUN, or by hand
# on a VM you then image): unpack it where the boot script looks for it, check every wheel against
# its SHA256SUMS, install the lock into the image's venv with no index and mark the venv as holding
# that lock, so a VM booted from the image installs only the run's own wheel (docs/cloud-pools.md,
# "Baking the wheelhouse into an image").
#   bake-wheelhouse.sh WHEELHOUSE.tar LOCK.txt [INSTALL_DIR (/opt/rlboost)] [PYTHON (python3)]
# WHEELHOUSE.tar and LOCK.txt: a run's <weights store>/code/<sha256>/rlboost-wheelhouse-*.tar and
# requirements-<extras>.txt (its log names both), fetched with gcloud storage cp / aws s3 cp / az.
set -euo pipefail
archive=$1 lock=$2 root=${3:-/opt/rlboost} python=${4:-python3}
sha=$(sha256sum "$archive" | cut -d' ' -f1)
home=$root/wheelhouse/$sha
mkdir -p "$root/boot" "$home"
tar -xf "$archive" -C "$home"
(cd "$home" && sha256sum --quiet --strict -c SHA256SUMS) || { echo "bake-wheelhouse: $archive has a wheel that fails its SHA256SUMS: fetch it again" >&2; exit 1; }
cp "$lock" "$root/boot/"
[ -x "$root/venv/bin/python" ] || "$python" -m venv --system-site-packages "$root/venv"
"$root/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --no-index --find-links "$home" -r "$lock"
sha256sum "$lock" | cut -d' ' -f1 > "$root/venv/.rlboost-lock-sha256"
echo "bake-wheelhouse: $root/venv holds $(basename "$lock") from the wheelhouse $sha"
