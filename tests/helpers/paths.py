"""Where things are: the repository, its read-only tree of recorded facts (fixtures/), and short temporary
directories for unix sockets."""

from __future__ import annotations

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
