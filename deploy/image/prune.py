"""Trim the image's virtual environment of what the product never loads, then prove it still imports.

Run by the build stage with the base image's Python (it has pip; the environment has none):
    python deploy/image/prune.py /opt/gpu-topology
Removed: test suites shipped inside wheels, the kubernetes client's asyncio flavour (`kubernetes.aio`, the largest
part of the image; the product uses the synchronous client) and the distributions only that flavour needs. The
check afterwards imports every module of the product and the kubernetes client parts it uses with the
environment's own interpreter, so a prune that removed something needed fails the build, not a pod.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

# Required by kubernetes only for kubernetes.aio (tests/deploy/test_dockerfiles.py keeps this list exact).
AIO_ONLY_DISTRIBUTIONS = ("aiohappyeyeballs", "aiohttp", "aiohttp-retry", "aiosignal", "attrs", "frozenlist",
                          "multidict", "propcache", "yarl")
PRODUCT_PACKAGES = ("gputopo", "gpuplugin", "extender")
IMPORT_CHECK = (
    "import importlib, pkgutil, sys\n"
    "import kubernetes.client, kubernetes.config, kubernetes.watch\n"
    "names = []\n"
    "for package in sys.argv[1:]:\n"
    "    module = importlib.import_module(package)\n"
    "    names += [m.name for m in pkgutil.walk_packages(module.__path__, package + '.')]\n"
    "for name in names:\n"
    "    importlib.import_module(name)\n"
    "print(f'imports: {len(names)} modules of the product load after pruning')\n"
)


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def prune(venv: Path) -> int:
    """Delete the pruned files; returns the bytes freed."""
    site = site_packages(venv)
    before = _size(venv)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "uninstall", "--yes",
                    "--quiet", *AIO_ONLY_DISTRIBUTIONS], check=True)
    shutil.rmtree(site / "kubernetes" / "aio", ignore_errors=True)
    for tests in sorted(site.glob("*/**/tests"), reverse=True):
        if tests.is_dir() and tests.parent.name not in PRODUCT_PACKAGES:
            shutil.rmtree(tests)
    return before - _size(venv)


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def check_imports(venv: Path) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-c", IMPORT_CHECK, *PRODUCT_PACKAGES], check=True)


def main() -> int:
    venv = Path(sys.argv[1])
    freed = prune(venv)
    check_imports(venv)
    print(f"pruned {freed / 2**20:.1f} MiB; environment now {_size(venv) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
