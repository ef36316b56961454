"""The images' install steps work: the build stage's COPY set builds a wheel, which installs into a fresh
environment holding the locked runtime dependencies; both console scripts run from there, and after prune.py drops
the other half (per image) the one left still runs, with no entry point naming what is gone.

This is the fast, offline replay run by every suite; scripts/build_image.sh builds the real images with buildah and
runs each one's binary inside it (tests/deploy/test_image_build.py, when GPU_TOPOLOGY_IMAGE_TEST=1). Here the steps
are replayed, not executed by a container engine: the context is the Dockerfiles' COPY set (the same for both
images but for the lock, which tests/deploy/test_dockerfiles.py proves) from the build context (after
.dockerignore), the wheel is built with --no-build-isolation (the Dockerfiles build it isolated with setuptools
fetched from the index), and the fresh virtual environment sees the locked dependencies through a .pth line onto the
tested environment's site-packages (the Dockerfiles install the same versions from deploy/requirements-plugin.txt
or -extender.txt). The test then checks that the packages really come from the wheel and that every pin satisfies
the wheel's own requirements. The libraries each image must lack are proven absent by the real build (prune.py's
check and scripts/build_image.sh), since this replay's environment sees the tested one's.
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

from deploy.image import prune
from tests.deploy import dockerfiles, runtime_lock
from tests.deploy.rendering import ROOT

pytestmark = pytest.mark.timeout(180)


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Replay the build stage of Dockerfile.plugin (Dockerfile.extender's copies the same sources)."""
    tmp = tmp_path_factory.mktemp("image")
    context = dockerfiles.build_context(ROOT)
    src = tmp / "src"
    for copy in dockerfiles.copies(dockerfiles.DOCKERFILES["plugin"]):
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


@pytest.mark.parametrize("component", sorted(prune.COMPONENTS))
def test_each_half_runs_after_the_other_is_dropped(built: dict[str, Path], component: str, tmp_path: Path) -> None:
    """prune.py's removal of the other half, replayed on a copy of the fresh environment: the image's own console
    script and its subcommands still load (`gpuplugin --help` lists every subcommand, so a `demo` entry point left
    naming the removed simulator would fail it), the other script and packages are gone."""
    venv = tmp_path / "venv"
    shutil.copytree(built["venv"], venv, symlinks=True)
    site = Path(_run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    # The venv's scripts name their interpreter by absolute path: point them at the copy.
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink() and script.read_bytes().startswith(b"#!"):
            script.write_text(script.read_text().replace(str(built["venv"]), str(venv)))
    prune._drop_other_half(venv, site, prune.COMPONENTS[component])
    kept = prune.COMPONENTS[component].packages
    assert sorted(p.name for p in site.iterdir() if p.name in prune.PRODUCT_PACKAGES) == sorted(kept)
    bin_dir = venv / "bin"
    if component == "plugin":
        assert not (bin_dir / "gpu-extender").exists()
        help_text = _run(bin_dir / "gpuplugin", "--help")
        assert "run" in help_text and "dra" in help_text and "demo" not in help_text
        assert "NVLink islands" in _run(bin_dir / "gpuplugin", "topo")
    else:
        assert not (bin_dir / "gpuplugin").exists()
        assert "--inventory" in _run(bin_dir / "gpu-extender", "serve", "--help")
        assert "--tls-cert" in _run(bin_dir / "gpu-extender", "webhook", "--help")
    names = ", ".join(kept)
    where = _run(bin_dir / "python", "-c", f"import {names}\nfor m in ({names},): print(m.__file__)", cwd=venv).split()
    assert all(Path(p).is_relative_to(site) for p in where), where


@pytest.mark.parametrize("component", sorted(prune.COMPONENTS))
def test_locked_versions_satisfy_the_wheels_requirements(built: dict[str, Path], component: str) -> None:
    """What an image installs (its lock) is what the fresh environment sees and what the wheel asks for: the base
    requirements and those of the image's extra, nothing missing."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "from packaging.requirements import Requirement\n"
        "from packaging.utils import canonicalize_name as c\n"
        "locked, extra = json.loads(sys.argv[1]), sys.argv[2]\n"
        "bad = [f'{n}: sees {m.version(n)}, lock {v}' for n, v in locked.items() if m.version(n) != v]\n"
        "for spec in m.distribution('gpu-topology-scheduling').requires or []:\n"
        "    r = Requirement(spec)\n"
        "    if r.marker is not None and not r.marker.evaluate({'extra': extra}):\n"
        "        continue\n"
        "    if not r.specifier.contains(locked.get(c(r.name), ''), prereleases=True):\n"
        "        bad.append(f'wheel wants {spec}, lock has {locked.get(c(r.name))}')\n"
        "print('\\n'.join(bad))\n"
    )
    locked = runtime_lock.parse_lock(runtime_lock.lock_file(component).read_text())
    out = _run(built["venv"] / "bin" / "python", "-c", code, json.dumps(locked), component, cwd=built["venv"])
    assert out.strip() == ""
