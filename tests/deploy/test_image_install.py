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

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deploy.image import prune
from gputopo import extras
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


# Every subcommand of each console script, as the images and the chart run them.
SUBCOMMANDS = {"gpuplugin": ("run", "topo", "plan", "record", "slices", "dra", "mps-control", "demo"),
               "gpu-extender": ("serve", "webhook")}


def _helps(bin_dir: Path, commands: list[tuple[str, ...]], cwd: Path) -> dict[tuple[str, ...], str]:
    """`--help` of each command line, run side by side (each is a fresh interpreter); fails on any exit but 0."""
    procs = {c: subprocess.Popen([str(bin_dir / c[0]), *c[1:], "--help"], cwd=cwd, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for c in commands}
    out = {}
    for command, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0 and not stderr, f"{' '.join(command)} --help: exit {proc.returncode}\n{stderr}"
        out[command] = stdout
    return out


def test_every_subcommand_answers_help_from_the_fresh_environment(built: dict[str, Path], tmp_path: Path) -> None:
    commands = [(script,) for script in SUBCOMMANDS] + [(s, c) for s, cs in SUBCOMMANDS.items() for c in cs]
    helps = _helps(built["venv"] / "bin", commands, tmp_path)
    for script, subcommands in SUBCOMMANDS.items():
        assert all(c in helps[(script,)] for c in subcommands), helps[(script,)]
        assert all(helps[(script, c)].startswith("Usage: ") for c in subcommands)
    assert list(tmp_path.iterdir()) == []


# Installed in the fresh environment's path ahead of everything: makes the named modules (and their submodules)
# absent, as on `pip install gpu-topology-scheduling` without the extra that brings them.
_ABSENT = """
import importlib.abc, os, sys
_names = set(filter(None, os.environ.get("ABSENT_MODULES", "").split(",")))
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == n or name.startswith(n + ".") for n in _names):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""
# What each subcommand needs beyond the base install (gpuplugin/cli.py, extender/cli.py).
NEEDS = {("gpuplugin", c): "plugin" for c in ("run", "record", "slices", "dra", "mps-control", "node-template")} | {
    ("gpuplugin", "demo"): "demo", ("gpu-extender", "serve"): "extender", ("gpu-extender", "webhook"): "extender"}


def _run_without(bin_dir: Path, absent: set[str], commands: list[tuple[str, ...]], tmp: Path
                 ) -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """Run each command line side by side, with the `absent` modules made unimportable."""
    hook = tmp / "absent-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_ABSENT)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(hook), "ABSENT_MODULES": ",".join(sorted(absent))}
    procs = {c: subprocess.Popen([str(bin_dir / c[0]), *c[1:]], cwd=tmp, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for c in commands}
    done = {c: p.communicate(timeout=120) for c, p in procs.items()}
    return {c: subprocess.CompletedProcess(c, procs[c].returncode, *out) for c, out in done.items()}


def test_a_command_without_its_extra_says_so_in_one_line(built: dict[str, Path], tmp_path: Path) -> None:
    """On a bare install each command needing an extra answers its --help and a real run with one line naming the
    missing module and the extra to install, exit 2, no traceback; the ones needing nothing more still work."""
    bin_dir = built["venv"] / "bin"
    every = set(extras.EXTRAS["demo"])
    commands = [(*c, *args) for c in NEEDS for args in (("--help",), ("--bogus-flag",))]
    commands += [("gpuplugin", "run", "--node-name", "n1"), ("gpu-extender", "serve", "--inventory", "x.yaml")]
    for command, result in _run_without(bin_dir, every, commands, tmp_path).items():
        extra = NEEDS[command[:2]]
        want = (f"{' '.join(command[:2])} needs the {extra!r} extra (missing module {extras.EXTRAS[extra][0]}): "
                f"pip install 'gpu-topology-scheduling[{extra}]'\n")
        assert (result.returncode, result.stdout, result.stderr) == (2, "", want), (command, result.stderr[-2000:])
    bare = _run_without(bin_dir, every, [("gpuplugin", "--help"), ("gpu-extender", "--help"), ("gpuplugin", "topo"),
                                         ("gpuplugin", "plan", "--help")], tmp_path)
    assert all(r.returncode == 0 and r.stderr == "" for r in bare.values()), bare
    assert re.search(r"^  run +\(not installed: pip install 'gpu-topology-scheduling\[plugin\]'\)$",
                     bare[("gpuplugin", "--help")].stdout, re.M), bare[("gpuplugin", "--help")].stdout
    assert "NVLink islands" in bare[("gpuplugin", "topo")].stdout
    # The demo's own library alone missing is named too.
    (demo,) = _run_without(bin_dir, {"httpx"}, [("gpuplugin", "demo")], tmp_path).values()
    assert (demo.returncode, demo.stderr) == (2, "gpuplugin demo needs the 'demo' extra (missing module httpx): "
                                                 "pip install 'gpu-topology-scheduling[demo]'\n")


def test_each_commands_extra_is_all_it_needs(built: dict[str, Path], tmp_path: Path) -> None:
    """With only its own extra installed (every other extra's modules absent), each command loads: the list above is
    complete, so no command shows a traceback where it should show the line."""
    bin_dir = built["venv"] / "bin"
    for extra in ("plugin", "extender"):
        others = set(extras.EXTRAS["demo"]) - set(extras.EXTRAS[extra])
        commands = [(*c, "--help") for c, e in NEEDS.items() if e == extra]
        for command, result in _run_without(bin_dir, others, commands, tmp_path).items():
            assert result.returncode == 0 and result.stdout.startswith("Usage: "), (command, result.stderr[-2000:])


def test_the_extras_modules_are_what_pyprojects_extras_install() -> None:
    """gputopo.extras names, for each extra, modules of exactly the distributions pyproject.toml's extra lists."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    providers = importlib.metadata.packages_distributions()

    def names(extra: str) -> set[str]:
        out: set[str] = set()
        for spec in optional[extra]:
            requirement = Requirement(spec)
            if requirement.name == "gpu-topology-scheduling":
                out |= set().union(*(names(e) for e in requirement.extras))
            else:
                out.add(canonicalize_name(requirement.name))
        return out

    for extra, modules in extras.EXTRAS.items():
        provided = {canonicalize_name(d) for m in modules for d in providers[m.split(".")[0]]}
        if "google.protobuf" in modules:  # `google` is a namespace shared by several distributions
            provided = provided - {canonicalize_name(d) for d in providers["google"]} | {"protobuf"}
        assert provided == names(extra), extra


def _copy_venv(built: dict[str, Path], venv: Path) -> Path:
    """A copy of the fresh environment, its scripts pointed at the copy's interpreter; returns its site-packages."""
    shutil.copytree(built["venv"], venv, symlinks=True)
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink() and script.read_bytes().startswith(b"#!"):
            script.write_text(script.read_text().replace(str(built["venv"]), str(venv)))
    return Path(_run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())


@pytest.mark.parametrize("component", sorted(prune.COMPONENTS))
def test_each_half_runs_after_the_other_is_dropped(built: dict[str, Path], component: str, tmp_path: Path) -> None:
    """prune.py's prune and the import part of its check, run as the build runs them on a copy of the fresh
    environment: every module left imports in silence, the image's own console script and each of its subcommands
    still load (`gpuplugin --help` lists every subcommand, so a `demo` entry point left naming the removed simulator
    would fail it), the other script and packages are gone."""
    venv = tmp_path / "venv"
    site = _copy_venv(built, venv)
    prune.prune(venv, prune.COMPONENTS[component])
    assert prune.check_imports(venv, prune.COMPONENTS[component], absent=False).startswith("imports: ")
    kept = prune.COMPONENTS[component].packages
    assert sorted(p.name for p in site.iterdir() if p.name in prune.PRODUCT_PACKAGES) == sorted(kept)
    bin_dir = venv / "bin"
    script = prune.COMPONENTS[component].script
    subcommands = [c for c in SUBCOMMANDS[script] if c != "demo"]
    helps = _helps(bin_dir, [(script,), *((script, c) for c in subcommands)], tmp_path)
    assert all(c in helps[(script,)] for c in subcommands)
    if component == "plugin":
        assert not (bin_dir / "gpu-extender").exists()
        assert "demo" not in helps[(script,)]
        assert "--device-list-strategy" in helps[(script, "run")]
        assert "NVLink islands" in _run(bin_dir / "gpuplugin", "topo")
    else:
        assert not (bin_dir / "gpuplugin").exists()
        assert "--inventory" in helps[(script, "serve")] and "--tls-cert" in helps[(script, "webhook")]
    names = ", ".join(kept)
    where = _run(bin_dir / "python", "-c", f"import {names}\nfor m in ({names},): print(m.__file__)", cwd=venv).split()
    assert all(Path(p).is_relative_to(site) for p in where), where


def test_prune_check_fails_on_a_module_that_exits_when_imported(built: dict[str, Path], tmp_path: Path) -> None:
    """The check the build relies on is live: a module calling its main at import (as a `python -m` module of the
    extender once did) fails it, naming the module's complaint."""
    venv = tmp_path / "venv"
    site = _copy_venv(built, venv)
    (site / "extender" / "main_at_import.py").write_text(
        "import argparse\n\nparser = argparse.ArgumentParser()\nparser.add_argument('--channel-fd', required=True)\n"
        "parser.parse_args([])\n")
    with pytest.raises(prune.CheckFailed, match="the following arguments are required: --channel-fd"):
        prune.check_imports(venv, prune.COMPONENTS["extender"], absent=False)


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
