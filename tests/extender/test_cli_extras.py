"""`gpu-extender` where the `extender` extra is not installed (`pip install gpu-topology-scheduling` alone), as a real
process: its --help marks the commands that need the extra with what to install, as `gpuplugin --help` does, and
running one answers with that one line and exit 2. The extra's modules are made unimportable by a sitecustomize hook,
the way tests/deploy/test_image_install.py simulates a bare install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gputopo import extras
from tests.helpers.paths import REPO

# Any import of one of ABSENT_MODULES (or a submodule) fails as if its distribution were not installed.
_ABSENT_HOOK = '''
import importlib.abc, os, sys
_names = set(filter(None, os.environ.get("ABSENT_MODULES", "").split(",")))
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == n or name.startswith(n + ".") for n in _names):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
'''
INSTALL = f"pip install '{extras.DISTRIBUTION}[extender]'"


@pytest.fixture
def bare(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that cannot import the extender extra's modules."""
    (tmp_path / "sitecustomize.py").write_text(_ABSENT_HOOK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_EXTENDER_")}
    return env | {"PYTHONPATH": str(tmp_path), "ABSENT_MODULES": ",".join(extras.EXTRAS["extender"])}


def _gpu_extender(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extender.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_help_marks_the_commands_whose_extra_is_missing(bare: dict[str, str]) -> None:
    result = _gpu_extender(bare, "--help")
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    for command in ("serve", "webhook"):
        assert re.search(rf"^  {command} +\(not installed: {re.escape(INSTALL)}\)$", result.stdout, re.M), (
            result.stdout)


@pytest.mark.parametrize("args", [("serve", "--inventory", "x.yaml"), ("serve", "--help"),
                                  ("webhook", "--bogus-flag")])
def test_a_command_without_its_extra_exits_with_one_line(bare: dict[str, str], args: tuple[str, ...]) -> None:
    result = _gpu_extender(bare, *args)
    want = (f"gpu-extender {args[0]} needs the 'extender' extra (missing module {extras.EXTRAS['extender'][0]}): "
            f"{INSTALL}\n")
    assert (result.returncode, result.stdout, result.stderr) == (extras.EXIT_MISSING_EXTRA, "", want)
