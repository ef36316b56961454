"""The image's install steps work: the build stage's COPY set builds a wheel, which installs into a fresh
environment holding the locked runtime dependencies, and both console scripts run from there.

This is the fast, offline replay run by every suite; scripts/build_image.sh builds the real image with buildah and
runs both binaries inside it (tests/deploy/test_image_build.py, when GPU_TOPOLOGY_IMAGE_TEST=1). Here the steps are
replayed, not executed by a container engine: the context is the
Dockerfile's COPY set from the build context (after .dockerignore), the wheel is built with --no-build-isolation
(the Dockerfile builds it isolated with setuptools fetched from the index), and the fresh virtual environment
sees the locked dependencies through a .pth line onto the tested environment's site-packages (the Dockerfile
installs the same versions from wheels built from deploy/requirements-runtime.txt). The test then checks that the
packages really come from the wheel and that every pin satisfies the wheel's own requirements.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.deploy import dockerfiles, runtime_lock
from tests.deploy.rendering import ROOT

pytestmark = pytest.mark.timeout(180)


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Replay the build stage of the Dockerfile."""
    tmp = tmp_path_factory.mktemp("image")
    context = dockerfiles.build_context(ROOT)
    src = tmp / "src"
    for copy in dockerfiles.copies(dockerfiles.DOCKERFILE):
        if copy.stage != "build" or copy.from_stage:
            continue
        for source in copy.sources:
            source = source.rstrip("/")
            files = [f for f in context if f == source or f.startswith(source + "/")]
            assert files, f"COPY {source}: nothing in the build context (README.md must exist at the root)"
            for name in files:
                # COPY <file> <dir>/ keeps the name; COPY <dir> <dir> copies the contents; COPY a b renames.
                relative = Path(name).relative_to(source) if name != source else Path()
                target = src / copy.destination / relative if relative != Path() else src / copy.destination
                if copy.destination.endswith("/") and relative == Path():
                    target = src / copy.destination / Path(name).name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / name, target)
    wheels = tmp / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-cache-dir", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", wheels, ".", cwd=src)
    (wheel,) = wheels.glob("gpu_topology_scheduling-*.whl")
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    site = Path(_run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    (site / "locked-runtime-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # The runtime stage's install, less the dependencies (already present at the locked versions).
    _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet", "--no-cache-dir",
         "--no-index", "--no-deps", wheel)
    return {"wheel": wheel, "venv": venv, "site": site, "src": src}


def test_wheel_holds_every_module_and_data_file(built: dict[str, Path]) -> None:
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    for package in ("gputopo", "gpuplugin", "extender", "sim"):
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if "__pycache__" not in relative:
                assert relative in names, f"{relative} is not in the wheel"
    for path in (ROOT / "gputopo" / "data").iterdir():
        assert path.relative_to(ROOT).as_posix() in names


def test_console_scripts_run_from_the_fresh_environment(built: dict[str, Path]) -> None:
    bin_dir = built["venv"] / "bin"
    assert "run" in _run(bin_dir / "gpuplugin", "--help")
    assert "--device-list-strategy" in _run(bin_dir / "gpuplugin", "run", "--help")
    assert "serve" in _run(bin_dir / "gpu-extender", "--help")
    assert "--tls-client-ca" in _run(bin_dir / "gpu-extender", "serve", "--help")
    where = _run(bin_dir / "python", "-c", "import gputopo, gpuplugin, extender, sim\n"
                 "for m in (gputopo, gpuplugin, extender, sim): print(m.__file__)", cwd=built["venv"]).split()
    assert all(Path(p).is_relative_to(built["site"]) for p in where), f"imported from outside the wheel: {where}"


def test_demo_runs_from_the_fresh_environment(built: dict[str, Path], tmp_path: Path) -> None:
    """`pip install .` (not editable) then `gpuplugin demo`: the simulator and its dependencies come with the wheel."""
    out = _run(built["venv"] / "bin" / "gpuplugin", "demo", "--pods", "4", "--out", tmp_path / "demo", cwd=tmp_path)
    assert "processes and sockets left behind: none" in out


def test_locked_versions_satisfy_the_wheels_requirements(built: dict[str, Path]) -> None:
    """What the image installs (the lock) is what the fresh environment sees and what the wheel asks for."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "from packaging.requirements import Requirement\n"
        "from packaging.utils import canonicalize_name as c\n"
        "locked = json.loads(sys.argv[1])\n"
        "bad = [f'{n}: sees {m.version(n)}, lock {v}' for n, v in locked.items() if m.version(n) != v]\n"
        "for spec in m.distribution('gpu-topology-scheduling').requires or []:\n"
        "    r = Requirement(spec)\n"
        "    if r.marker is None and not r.specifier.contains(locked.get(c(r.name), ''), prereleases=True):\n"
        "        bad.append(f'wheel wants {spec}, lock has {locked.get(c(r.name))}')\n"
        "print('\\n'.join(bad))\n"
    )
    locked = runtime_lock.parse_lock(runtime_lock.LOCK_FILE.read_text())
    out = _run(built["venv"] / "bin" / "python", "-c", code, json.dumps(locked), cwd=built["venv"])
    assert out.strip() == ""
