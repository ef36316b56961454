#!/usr/bin/env bash
# The two commands of the README: `./dev.sh demo` and `./dev.sh test`. Both set up .venv first (idempotent).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

setup() {
  if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    # Debian ships venv separately; install it when we may, else say what is missing.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    else
      echo "python3 venv support is missing: sudo apt-get install python3-venv" >&2
      exit 1
    fi
  fi
  if ! command -v etcd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # The real-control-plane tier (tests/helpers/controlplane.py) runs its own etcd (own ports, own data dir); a
    # policy-rc.d for the install keeps Debian's etcd service from starting, nothing here uses it.
    rc=/usr/sbin/policy-rc.d; own_rc=; [ -e $rc ] || { printf '#!/bin/sh\nexit 101\n' >$rc; chmod +x $rc; own_rc=1; }
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; } \
      || echo "etcd-server not installed: the real-control-plane tier will skip" >&2
    [ -z "$own_rc" ] || rm -f $rc
  fi
  if [ ! -x .venv/bin/python ] || [ pyproject.toml -nt .venv/.installed ] \
      || [ deploy/requirements-runtime.txt -nt .venv/.installed ]; then
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    # The runtime closure at exactly the versions the image ships (the lock), whatever is newer on the index today.
    .venv/bin/python -m pip install -q -c deploy/requirements-runtime.txt -e '.[test]'
    touch .venv/.installed
  fi
}

case "${1:-}" in
  demo)
    setup
    shift
    exec .venv/bin/gpuplugin demo "$@"
    ;;
  test)
    setup
    shift
    .venv/bin/ruff check .
    exec .venv/bin/python -m pytest -q --durations=15 "$@"
    ;;
  setup)
    setup
    ;;
  *)
    echo "usage: ./dev.sh demo | test [pytest args] | setup" >&2
    exit 2
    ;;
esac
