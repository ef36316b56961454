"""The repository stands alone: a copy of it, with no `shared` folder (or anything else) beside it, collects the
whole suite and passes the tests that read the recordings, the topologies, the protocol references and the README's
examples, without writing a byte under fixtures/. CI may keep the shared fixture tree beside the clone; nothing may
depend on it.

One test, bounded (collection of the whole suite is most of it), because a copy of the repository is the only way
to prove that no path climbs out of it. The copy's pytest runs with --assert=plain: rewriting every module's asserts
(for richer failure messages) doubles the collection's time, and a failing assert fails the run just the same."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO, fixture_changes, fixture_manifest

# Set in the copy's environment, so that the copy never copies itself again.
IN_COPY = "GPU_TOPOLOGY_STANDALONE_COPY"
# A path that climbs to the tree beside the repository, written so that this file does not match itself.
CLIMBING = re.compile(rb"\.\./shared")

# Tests that read what used to live outside the repository: every topology and recording through the loaders and
# the codec, the 2x H200 NVML recording, the protocol references, and the README's examples (node id prefixes: of
# test_codec.py only the round trip of every topology file, its other tests read no file). Fast ones: the whole
# suite's collection already imports every module that reads a fixture at import time.
READERS = (
    "tests/gputopo/discovery/test_loader.py",
    "tests/gputopo/discovery/test_real_h200.py",
    "tests/gputopo/core/test_codec.py::test_fixture_round_trip[",
    "tests/gpuplugin/proto/test_deviceplugin.py",
    "tests/gpuplugin/proto/test_dra.py",
    "tests/deploy/test_readme.py",
)
# One pytest process collects the whole suite (a collection error fails the run) and runs only the readers: a
# second process would import everything again.
SELECTION = f"""
READERS = {READERS!r}


def pytest_collection_modifyitems(config, items):
    chosen = [item for item in items if item.nodeid.startswith(READERS)]
    unmatched = [name for name in READERS if not any(item.nodeid.startswith(name) for item in chosen)]
    if unmatched:
        raise ValueError(f"no test collected for {{unmatched}}")
    config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
    items[:] = chosen
"""


def tracked_and_new_files() -> list[str]:
    """What a clone holds, plus what is not committed yet but not ignored (so the test checks the work in progress
    too): never .venv, build outputs or caches."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=30).stdout
    return [name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


def copy_of_the_repository(into: Path) -> Path:
    clone = into / "gpu-topology-scheduling"
    for name in tracked_and_new_files():
        target = clone / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return clone


def read_only(tree: Path) -> None:
    """chmod a-w: what an unprivileged run would trip on. Root ignores modes, hence the manifest as well."""
    for path in [tree, *tree.rglob("*")]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def run_in(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # `python -m pytest` puts the working directory first on sys.path, so the copy's packages are the ones imported
    # (the virtual environment's editable install points at the original checkout; the check below proves it).
    env = {**os.environ, IN_COPY: "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(os.environ.get(IN_COPY) == "1", reason="already running inside the copy")
@pytest.mark.timeout(300)
def test_a_copy_with_nothing_beside_it_collects_and_runs_the_fixture_readers(tmp_path: Path) -> None:
    clone = copy_of_the_repository(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [clone.name], "the copy must have no sibling"

    # No text in the repository names the tree beside it.
    climbing = [str(p.relative_to(clone)) for p in clone.rglob("*")
                if p.is_file() and CLIMBING.search(p.read_bytes())]
    assert not climbing, f"files naming the folder beside the repository: {climbing}"

    read_only(clone / "fixtures")
    before = fixture_manifest(clone / "fixtures")

    where = run_in(clone, "-c", "import gputopo, tests.helpers.paths as p; print(gputopo.__file__); print(p.SHARED)")
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(clone)) for line in where.stdout.split()), where.stdout

    (clone / "standalone_selection.py").write_text(SELECTION)
    ran = run_in(clone, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "standalone_selection", "--assert=plain",
                 "tests")
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    summary = ran.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "deselected" in summary and "error" not in summary, summary

    assert not fixture_changes(before, fixture_manifest(clone / "fixtures"))


def test_the_manifest_sees_every_kind_of_write(tmp_path: Path) -> None:
    """The run-wide read-only check (tests/conftest.py) rests on this comparison; prove it catches a change, an
    added file and a removed one."""
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("GPU0")
    before = fixture_manifest(tmp_path)
    assert fixture_changes(before, fixture_manifest(tmp_path)) == []
    (tmp_path / "a.json").write_text("{ }")
    (tmp_path / "sub" / "b.txt").unlink()
    (tmp_path / "sub" / "c.txt").write_text("")
    assert fixture_changes(before, fixture_manifest(tmp_path)) == ["changed a.json", "added sub/c.txt",
                                                                   "removed sub/b.txt"]
