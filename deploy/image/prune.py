"""Trim an image's virtual environment of what its component never loads, then prove it still imports.

Run by the build stage of Dockerfile.plugin and Dockerfile.extender with the base image's Python (it has pip; the
environment has none):
    python deploy/image/prune.py /opt/gpu-topology plugin|extender
Removed: the other half of the product, the simulator (the demo runs both halves, from a checkout) and their
console scripts and entry points, since the image does not install their libraries (the plugin image has no
FastAPI, the extender image no NVML or gRPC); test suites shipped inside wheels; the kubernetes client's asyncio
flavour (`kubernetes.aio`, the largest part of the image; the product uses the synchronous client) and the
distributions only that flavour needs. The check afterwards imports every module left of the product and the
kubernetes client parts it uses with the environment's own interpreter (each in silence: a module that exits, raises
or prints when imported fails it), and proves the other half's libraries are absent, so a prune that removed
something needed fails the build, not a pod. tests/deploy/test_image_install.py runs prune() and the import part of
the check on a replay of the build; only the real build can prove the absence.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Required by kubernetes only for kubernetes.aio (tests/deploy/test_dockerfiles.py keeps this list exact).
AIO_ONLY_DISTRIBUTIONS = ("aiohappyeyeballs", "aiohttp", "aiohttp-retry", "aiosignal", "attrs", "frozenlist",
                          "multidict", "propcache", "yarl")
PRODUCT_PACKAGES = ("gputopo", "gpuplugin", "extender", "sim")


@dataclass(frozen=True)
class Component:
    packages: tuple[str, ...]  # what the image keeps of the product
    script: str  # its console script; the other one goes with the other half
    absent: tuple[str, ...]  # top-level modules of the other half's libraries, which the image must not hold


COMPONENTS = {
    "plugin": Component(("gputopo", "gpuplugin"), "gpuplugin", ("fastapi", "uvicorn", "starlette")),
    "extender": Component(("gputopo", "extender"), "gpu-extender", ("pynvml", "grpc", "google.protobuf", "watchdog")),
}
# Modules are listed from the files (pkgutil.walk_packages skips directories without __init__.py, such as
# gpuplugin/sharing); each one must import without exiting, raising or printing.
IMPORT_CHECK = (
    "import importlib, importlib.util, pathlib, sys\n"
    "import kubernetes.client, kubernetes.config, kubernetes.watch\n"
    "packages, absent = sys.argv[1].split(','), [a for a in sys.argv[2].split(',') if a]\n"
    "names = []\n"
    "for package in packages:\n"
    "    for root in map(pathlib.Path, importlib.import_module(package).__path__):\n"
    "        assert root.is_relative_to(sys.prefix), f'{package} loads from {root}, not the environment'\n"
    "        names += sorted('.'.join((package, *f.relative_to(root).with_suffix('').parts))\n"
    "                        .removesuffix('.__init__') for f in root.rglob('*.py') if '__pycache__' not in f.parts)\n"
    "for name in names:\n"
    "    importlib.import_module(name)\n"
    "present = [name for name in absent if all(importlib.util.find_spec('.'.join(name.split('.')[:i + 1]))\n"
    "                                          for i in range(name.count('.') + 1))]\n"
    "assert not present, f'the image holds the other half\\'s libraries: {present}'\n"
    "print(f'imports: {len(names)} modules of the product load after pruning'\n"
    "      + (f'; absent: {\", \".join(absent)}' if absent else ''))\n"
)


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def prune(venv: Path, component: Component) -> int:
    """Delete the pruned files; returns the bytes freed."""
    site = site_packages(venv)
    before = _size(venv)
    # Only what this environment itself holds: never a distribution it merely sees (a .pth onto another one).
    installed = [name for name in AIO_ONLY_DISTRIBUTIONS
                 if any(site.glob(f"{name.replace('-', '_')}-*.dist-info"))]
    if installed:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "uninstall", "--yes",
                        "--quiet", *installed], check=True)
    shutil.rmtree(site / "kubernetes" / "aio", ignore_errors=True)
    for tests in sorted(site.glob("*/**/tests"), reverse=True):
        if tests.is_dir() and tests.parent.name not in PRODUCT_PACKAGES:
            shutil.rmtree(tests)
    _drop_other_half(venv, site, component)
    return before - _size(venv)


def _drop_other_half(venv: Path, site: Path, component: Component) -> None:
    """The other half's packages and the simulator, the other console script, and the entry points that name them
    (`gpuplugin.commands`: the demo), so that `gpuplugin --help` lists only what the image can run."""
    for package in PRODUCT_PACKAGES:
        if package not in component.packages:
            shutil.rmtree(site / package)
    for other in {c.script for c in COMPONENTS.values()} - {component.script}:
        (venv / "bin" / other).unlink()
    (entry_points,) = site.glob("gpu_topology_scheduling-*.dist-info/entry_points.txt")
    kept, section = [], ""
    for line in entry_points.read_text().splitlines():
        if line.startswith("["):
            section = line
        value = line.partition("=")[2].strip()
        if line.startswith("[") or not value or value.split(".")[0].split(":")[0] in component.packages:
            kept.append(line)
        else:
            assert section in ("[console_scripts]", "[gpuplugin.commands]"), f"unknown entry point {line!r}"
    entry_points.write_text("\n".join(kept) + "\n")


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


class CheckFailed(Exception):
    pass


def check_imports(venv: Path, component: Component, *, absent: bool = True) -> str:
    """Every module left of the product imports in silence with the environment's own interpreter; with `absent`,
    the other half's libraries cannot be found. `absent=False` is for an environment that sees another one's
    libraries (the tests' replay of the build). Returns the summary line."""
    # -I: the build runs this from /src, which holds the sources; the check is of the environment, not of them.
    result = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", IMPORT_CHECK, ",".join(component.packages),
                             ",".join(component.absent) if absent else ""], cwd=venv, capture_output=True,
                            text=True)
    lines = result.stdout.splitlines()
    if result.returncode != 0 or result.stderr or len(lines) != 1 or not lines[0].startswith("imports: "):
        raise CheckFailed(f"import check failed (exit {result.returncode}):\n{result.stdout}{result.stderr}")
    return lines[0]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in COMPONENTS:
        print(f"usage: prune.py VENV {{{'|'.join(COMPONENTS)}}}", file=sys.stderr)
        return 2
    venv, component = Path(argv[0]), COMPONENTS[argv[1]]
    freed = prune(venv, component)
    try:
        print(check_imports(venv, component))
    except CheckFailed as e:
        print(e, file=sys.stderr)
        return 1
    print(f"pruned {freed / 2**20:.1f} MiB; environment now {_size(venv) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
