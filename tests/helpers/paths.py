"""Where things are: the repository, its read-only tree of recorded facts (fixtures/: SHARED, every part of the suite
reads it; tests/conftest.py fails the run that writes there, by the manifest below), the protocol references
(docs/reference/), and short temporary directories for unix sockets. Everything is inside the repository: a clone
alone runs the suite (tests/architecture/test_standalone.py proves it from a copy with nothing beside it)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO / "fixtures"
APISERVER_RECORDINGS = SHARED / "recordings" / "kube-apiserver"
REFERENCE = REPO / "docs" / "reference"  # the protocol references the recordings were checked against


@contextmanager
def short_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory under /tmp, removed on exit. A unix socket path must fit in 108 bytes, which pytest's
    tmp_path (deep under the system temp directory) does not leave room for."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fixture_manifest(root: Path = SHARED) -> dict[str, str]:
    """Every file under `root` by its path relative to it, with the SHA-256 of its bytes (253 files, 2 MB: 20 ms)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def fixture_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What differs between two manifests, one entry per file: `changed x`, `added x`, `removed x`."""
    return ([f"changed {name}" for name in sorted(before.keys() & after.keys()) if before[name] != after[name]]
            + [f"added {name}" for name in sorted(after.keys() - before.keys())]
            + [f"removed {name}" for name in sorted(before.keys() - after.keys())])
