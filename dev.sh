#!/usr/bin/env bash
# The two commands of the README: `./dev.sh demo` and `./dev.sh test`. Both set up .venv first (idempotent).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

setup() {  # setup EXTRA [EXTRA...]: install the first extra unless one of them is installed and current
  if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    # Debian ships venv separately; install it when we may, else say what is missing.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    else
      echo "python3 venv support is missing: sudo apt-get install python3-venv" >&2
      exit 1
    fi
  fi
  if [ "$1" = test ] && ! command -v etcd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # The real-control-plane tier (tests/helpers/controlplane.py) runs its own etcd (own ports, own data dir); a
    # policy-rc.d for the install keeps Debian's etcd service from starting, nothing here uses it.
    rc=/usr/sbin/policy-rc.d; own_rc=; [ -e $rc ] || { printf '#!/bin/sh\nexit 101\n' >$rc; chmod +x $rc; own_rc=1; }
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; } \
      || echo "etcd-server not installed: the real-control-plane tier will skip" >&2
    [ -z "$own_rc" ] || rm -f $rc
  fi
  [ -x .venv/bin/python ] || { "$PY" -m venv .venv && .venv/bin/python -m pip install -q --upgrade pip; }
  # One marker per extra set, newer than pyproject.toml and the lock while that set is installed. [test] includes
  # [demo], so `demo` after `test` installs nothing; `test` after `demo` adds the test tools.
  # A .venv/.installed from before the split stands for [test], which was all it installed then.
  [ ! -e .venv/.installed ] || mv .venv/.installed .venv/.installed-test
  local extra marker
  for extra in "$@"; do
    marker=.venv/.installed-$extra
    if [ ! pyproject.toml -nt "$marker" ] && [ ! deploy/requirements-runtime.txt -nt "$marker" ]; then return 0; fi
  done
  # The runtime closure at exactly the versions the image ships (the lock), whatever is newer on the index today.
  .venv/bin/python -m pip install -q -c deploy/requirements-runtime.txt -e ".[$1]"
  touch ".venv/.installed-$1"
}

case "${1:-}" in
  demo)
    setup demo test  # the demo's extra, or the test set which holds it
    shift
    exec .venv/bin/gpuplugin demo "$@"
    ;;
  test)
    setup test
    shift
    .venv/bin/ruff check .
    # -rs: each skipped test with its reason in the summary (a missing GPU, etcd or opt-in), not a bare count.
    exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
    ;;
  setup)
    setup test
    ;;
  *)
    echo "usage: ./dev.sh demo | test [pytest args] | setup" >&2
    exit 2
    ;;
esac
