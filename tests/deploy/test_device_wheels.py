"""The wheels scripts/device_wheels.sh carries to the GPU machine (which has no network) are enough for what runs
there: every module of the script's DEVICE_RUNS, and every project module those import on the way (the benchmarks
import the plugin inside functions), imports in an interpreter where nothing but those wheels and the image's own
packages (DEVICE_HAS) can be imported: stdlib, the project, and the distributions of the set. A dependency's own
dependencies are caught the same way (kubernetes needs python-dateutil). No network: the script's `--list` says what
it would download."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.deploy import runtime_lock
from tests.deploy.rendering import ROOT

SCRIPT = ROOT / "scripts" / "device_wheels.sh"
PACKAGES = frozenset(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])

# Runs in the child: a finder ahead of all others refuses any top-level module installed in site-packages (by a
# distribution or not) that the project does not own and no allowed distribution ships; then each module is imported.
_IMPORT_ON_DEVICE = r"""
import importlib, importlib.abc, importlib.machinery, importlib.metadata, json, re, site, sys

root, packages, allowed, modules = sys.argv[1], set(sys.argv[2].split(",")), set(sys.argv[3].split(",")), sys.argv[4:]
sys.path.insert(0, root)
owners = {top: {re.sub(r"[-_.]+", "-", d).lower() for d in dists}
          for top, dists in importlib.metadata.packages_distributions().items()}
sites = tuple(site.getsitepackages())

def installed(top):
    # a distribution's module, or anything else found in site-packages (stdlib and the project are not)
    if top in owners:
        return True
    spec = importlib.machinery.PathFinder.find_spec(top)
    places = [spec.origin or "", *(spec.submodule_search_locations or ())] if spec else []
    return any(str(p).startswith(sites) for p in places)

class Device(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in packages or not installed(top) or owners.get(top, set()) & allowed:
            return None
        raise ModuleNotFoundError(f"No module named {top!r} on the device (distribution: "
                                  f"{', '.join(sorted(owners.get(top, ()))) or 'unknown'})", name=top)

sys.meta_path.insert(0, Device())
failures = {}
for module in modules:
    try:
        importlib.import_module(module)
    except Exception as e:
        failures[module] = f"{type(e).__name__}: {e}"
print(json.dumps(failures))
"""


def script_array(name: str) -> list[str]:
    """A bash array the script declares on one line, `NAME=(a b c)`."""
    found = re.search(rf"^{name}=\(([^)]*)\)", SCRIPT.read_text(), re.MULTILINE)
    assert found, f"{SCRIPT.name} declares no {name}=(...)"
    return found.group(1).split()


def wheel_set() -> dict[str, str]:
    """What the script would download, {canonical name: version}, from its `--list` (no network)."""
    out = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, timeout=30, check=True)
    pins = [line.partition("==") for line in out.stdout.split()]
    assert pins and all(sep for _, sep, _ in pins), out.stdout
    return {canonicalize_name(name): version for name, _, version in pins}


def _source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imports(module: str, path: Path) -> Iterable[str]:
    """Every module name `path` imports, anywhere in it, relative imports resolved; `from a import b` also gives
    `a.b`, which is a module when b is one."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*parts, *([node.module] if node.module else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def reached(entry: Iterable[str]) -> list[str]:
    """The project modules `entry` imports, at top level or inside functions, those they import, and so on, with
    their parent packages (which Python imports first)."""
    seen: set[str] = set()
    pending = list(entry)
    while pending:
        module = pending.pop()
        if module in seen or (path := _source(module)) is None:
            continue
        seen.add(module)
        parts = module.split(".")
        pending += [".".join(parts[:k]) for k in range(1, len(parts))]
        pending += [m for m in _imports(module, path) if m.partition(".")[0] in PACKAGES]
    return sorted(seen)


def unimportable(modules: Iterable[str], allowed: Iterable[str]) -> dict[str, str]:
    """Module -> why it does not import where only the `allowed` distributions (and stdlib, the project) exist."""
    result = subprocess.run(
        [sys.executable, "-I", "-c", _IMPORT_ON_DEVICE, str(ROOT), ",".join(sorted(PACKAGES)),
         ",".join(sorted({canonicalize_name(a) for a in allowed})), *modules],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failures: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return failures


def device_has() -> set[str]:
    return {canonicalize_name(n) for n in script_array("DEVICE_HAS")}


def test_the_wheel_set_is_the_plugin_lock_less_what_the_device_image_has() -> None:
    lock = runtime_lock.parse_lock(runtime_lock.lock_file("plugin").read_text())
    assert re.search(r"^LOCK=deploy/requirements-plugin\.txt$", SCRIPT.read_text(), re.MULTILINE)
    assert wheel_set() == {n: v for n, v in lock.items() if n not in device_has()}
    assert "grpcio" not in device_has()  # the image's 1.84 is below the generated code's floor (1.85.1)


def test_every_module_run_on_the_device_imports_with_only_the_wheels_and_the_image() -> None:
    entry = script_array("DEVICE_RUNS")
    assert "bench.sharing" in entry and all(_source(m) for m in entry), entry
    modules = reached(entry)
    assert "gputopo.kube.client" in modules  # reached through the plugin that bench.sharing imports in a function
    assert unimportable(modules, {*wheel_set(), *device_has()}) == {}


@pytest.mark.parametrize("missing", ["kubernetes", "python-dateutil"])
def test_the_check_finds_a_missing_wheel_and_a_missing_dependency_of_one(missing: str) -> None:
    """Without kubernetes (the reported failure) or python-dateutil (only kubernetes needs it), bench.sharing's
    path into the plugin does not import."""
    allowed = {*wheel_set(), *device_has()} - {missing}
    failures = unimportable(reached(["bench.sharing"]), allowed)
    assert "gputopo.kube.client" in failures
    assert any(f"distribution: {missing})" in why for why in failures.values()), failures
