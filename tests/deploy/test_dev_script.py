"""dev.sh's setup: `demo` installs the demo's extra only, `test` the test extra; one .venv, one marker per extra
set, so neither order installs twice; `test` names every skipped test's reason. Run against a stand-in .venv whose
python records its arguments instead of installing anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.helpers.paths import REPO

FAKE = '#!/bin/sh\necho "$(basename "$0") $*" >>"$DEV_LOG"\n'


def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "clone"
    (root / "deploy").mkdir(parents=True)
    for name in ("dev.sh", "pyproject.toml", "deploy/requirements-runtime.txt"):
        shutil.copy2(REPO / name, root / name)
    past = time.time() - 60  # older than any marker setup writes
    for name in ("pyproject.toml", "deploy/requirements-runtime.txt"):
        os.utime(root / name, (past, past))
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    tools = tmp_path / "tools"  # an etcd on PATH, so that setup never reaches for apt-get
    tools.mkdir()
    for path in (bin_dir / "python", bin_dir / "gpuplugin", bin_dir / "ruff", tools / "etcd"):
        path.write_text(FAKE)
        path.chmod(0o755)
    return root


def dev(root: Path, *args: str) -> list[str]:
    """Runs dev.sh; the commands its stand-in tools were called with."""
    log = root.parent / "calls.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, DEV_LOG=str(log), PATH=f"{root.parent / 'tools'}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(root / "dev.sh"), *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def installs(calls: list[str]) -> list[str]:
    return [c.split()[-1] for c in calls if " pip install " in f" {c} " and " -e " in c]


def test_demo_installs_its_extra_only_and_test_adds_the_test_extra(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    first = dev(root, "demo")
    assert installs(first) == [".[demo]"]
    assert all("-c deploy/requirements-runtime.txt" in c for c in first if "pip install" in c)
    assert first[-1] == "gpuplugin demo"
    assert installs(dev(root, "demo")) == []  # idempotent
    assert installs(dev(root, "test")) == [".[test]"]
    assert installs(dev(root, "test")) == []
    assert installs(dev(root, "demo")) == []  # [test] holds [demo]


def test_test_first_then_demo_installs_nothing_more(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    assert installs(dev(root, "test")) == [".[test]"]
    assert installs(dev(root, "demo")) == []


def test_a_newer_pyproject_or_lock_installs_again(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    dev(root, "test")
    future = time.time() + 60
    os.utime(root / "pyproject.toml", (future, future))
    assert installs(dev(root, "demo")) == [".[demo]"]
    assert installs(dev(root, "test")) == [".[test]"]  # the demo's install left the test set stale
    os.utime(root / "deploy" / "requirements-runtime.txt", (future + 60, future + 60))
    assert installs(dev(root, "test")) == [".[test]"]


def test_the_marker_from_before_the_split_counts_as_the_test_set(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    (root / ".venv" / ".installed").touch()
    assert installs(dev(root, "demo")) == []
    assert installs(dev(root, "test")) == []


def test_the_test_command_lists_skip_reasons(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    calls = dev(root, "test", "tests/deploy", "-x")
    assert calls[-2] == "ruff check ."
    pytest_args = calls[-1].split()
    assert pytest_args[:3] == ["python", "-m", "pytest"] and "-rs" in pytest_args
    assert pytest_args[-2:] == ["tests/deploy", "-x"]
