"""The layout's direction (core <- gputopo <- gpuplugin | extender <- sim, bench, tests), enforced by import-linter
with the contracts in pyproject.toml; and proof that those contracts notice a forbidden import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("gputopo", "gpuplugin", "extender", "sim", "bench", "tests")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def copy_of_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's Python sources in a scratch directory, to add forbidden imports to."""
    root = tmp_path_factory.mktemp("tree")
    shutil.copy(REPO / "pyproject.toml", root)
    for package in PACKAGES:
        shutil.copytree(REPO / package, root / package, ignore=lambda _d, names: [
            n for n in names if not (n.endswith(".py") or (Path(_d) / n).is_dir()) or n == "__pycache__"])
    return root


def test_the_project_keeps_every_contract() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("extender/_forbidden.py", "import gpuplugin.plan_watch", "The extender never imports the plugin"),
        ("gpuplugin/_forbidden.py", "import extender.http.app", "The extender never imports the plugin"),
        ("gputopo/core/_forbidden.py", "import gputopo.kube", "The core is pure"),
        ("gputopo/core/_forbidden.py", "import kubernetes.client", "The core is pure"),
        ("gputopo/_forbidden.py", "import gpuplugin.publisher", "The shared library imports neither half"),
        ("gpuplugin/_forbidden.py", "import sim.kubelet", "The product never imports the simulator"),
        ("extender/_forbidden.py", "import tests.conftest", "The product never imports the simulator"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(copy_of_tree: Path, module: str, line: str, contract: str) -> None:
    path = copy_of_tree / module
    path.write_text(f'"""A deliberate violation."""\n\n{line}\n')
    try:
        result = _lint(copy_of_tree)
    finally:
        path.unlink()
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    broken = [ln for ln in result.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), result.stdout[-2000:]
