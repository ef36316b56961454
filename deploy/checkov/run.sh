#!/usr/bin/env bash
# Static security scan of everything deploy/ installs, with checkov from its OWN virtualenv (its pinned
# dependencies conflict with the project's). The first run installs it into $CHECKOV_VENV (default
# /tmp/checkov-venv): that takes a few minutes; later runs take seconds.
#   bash deploy/checkov/run.sh
# Scanned: the kustomize entry points (deploy/manifests, deploy/scheduler) and the Helm chart rendered with the
# variants of tests/deploy/rendering.py, all written as plain YAML (checkov's own kustomize/helm runners would
# need the kustomize and helm binaries). Skips are justified in deploy/checkov/.checkov.yaml and, for single
# resources, in their checkov.io/skip* annotations.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${CHECKOV_VENV:-/tmp/checkov-venv}
PYTHON=${PYTHON:-.venv/bin/python}
if [ ! -x "$VENV/bin/checkov" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --requirement deploy/checkov/requirements.txt
fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
"$PYTHON" -m tests.deploy.rendering "$OUT" >/dev/null
# BC_SKIP_MAPPING: no download of the vendor's guideline mapping (there is no network to reach it).
BC_SKIP_MAPPING=TRUE "$VENV/bin/checkov" --config-file deploy/checkov/.checkov.yaml --directory "$OUT"
