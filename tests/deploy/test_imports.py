"""Importing any module of the product does nothing but define things: no exit, no output, no argument parsing, no
files, no sockets, no threads. The image build relies on it (deploy/image/prune.py imports every module left in the
image and fails the build on the first one that exits or raises), and so does anything that imports a module to
inspect it (pkgutil walks, the import linter, documentation tools).

One fresh interpreter, started in an empty working directory, imports every module of gputopo, gpuplugin, extender
and sim with process-wide traps in place and writes what it saw to a report file outside that directory; the test
then also requires its stdout and stderr to be empty. A few seconds for the whole product.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.image.prune import PRODUCT_PACKAGES
from tests.deploy.rendering import ROOT

pytestmark = pytest.mark.timeout(120)
Imported = tuple[dict[str, Any], subprocess.CompletedProcess[str], Path]

# Runs in the child. Traps: argument parsing (argparse and click), sockets connecting or listening (a library may
# probe: urllib3 binds ::1 to learn whether IPv6 works), threads started. Every module is imported on its own, so one
# bad module is reported by name and the others are still checked.
_IMPORT_ALL = r"""
import argparse, importlib, json, socket, sys, threading, traceback
from pathlib import Path

report_path, packages = sys.argv[1], sys.argv[2].split(",")
seen = {"modules": [], "failures": {}, "parsed": [], "sockets": [], "threads": []}
current = "(start)"

def _trap(kind, original):
    def wrapper(self, *args, **kwargs):
        seen["parsed"].append(f"{kind} in {current}")
        return original(self, *args, **kwargs)
    return wrapper

argparse.ArgumentParser.parse_known_args = _trap("argparse", argparse.ArgumentParser.parse_known_args)
def _net(kind, original):
    def wrapper(self, *args, **kwargs):
        seen["sockets"].append(f"{kind} {args[:1]} in {current}")
        return original(self, *args, **kwargs)
    return wrapper

socket.socket.connect = _net("connect", socket.socket.connect)
socket.socket.connect_ex = _net("connect", socket.socket.connect_ex)
socket.socket.listen = _net("listen", socket.socket.listen)
import click
click.Command.main = _trap("click", click.Command.main)
threads_before = set(threading.enumerate())

# From the files, not pkgutil.walk_packages, which skips directories without __init__.py (namespace packages).
root = Path(sys.argv[3])
names = sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for package in packages for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)
for name in names:
    current = name
    try:
        importlib.import_module(name)
        seen["modules"].append(name)
    except BaseException as e:
        seen["failures"][name] = f"{type(e).__name__}: {e}" + ("" if not isinstance(e, Exception) else
                                                               " | " + traceback.format_exc(limit=-1).strip())
seen["threads"] = sorted(t.name for t in set(threading.enumerate()) - threads_before)
with open(report_path, "w") as f:
    json.dump(seen, f)
"""


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Imported:
    cwd = tmp_path_factory.mktemp("import-cwd")
    report = tmp_path_factory.mktemp("import-report") / "report.json"
    result = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(report), ",".join(PRODUCT_PACKAGES), str(ROOT)],
                            cwd=cwd, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                          "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True, timeout=100)
    assert report.exists(), f"the import run ended early (rc {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(report.read_text()), result, cwd


def test_every_module_of_every_component_imports(imported: Imported) -> None:
    seen, _, _ = imported
    assert seen["failures"] == {}, "\n".join(f"{name}: {why}" for name, why in seen["failures"].items())
    # Every package really walked, the directories without __init__.py too (gpuplugin.sharing).
    assert {name.split(".")[0] for name in seen["modules"]} == set(PRODUCT_PACKAGES)
    assert len(seen["modules"]) > 150 and "extender.cli" in seen["modules"]


def test_importing_prints_nothing_and_exits_nothing(imported: Imported) -> None:
    _, result, _ = imported
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "" and result.stderr == "", (result.stdout + result.stderr)[-2000:]


def test_importing_parses_no_arguments_and_opens_no_sockets_or_threads(imported: Imported) -> None:
    seen, _, _ = imported
    assert seen["parsed"] == [], f"argument parsing at import time: {seen['parsed']}"
    assert seen["sockets"] == [], f"sockets created at import time by: {seen['sockets']}"
    assert seen["threads"] == [], f"threads started at import time: {seen['threads']}"


def test_importing_writes_no_files(imported: Imported) -> None:
    _, _, cwd = imported
    assert sorted(p.name for p in cwd.iterdir()) == []
