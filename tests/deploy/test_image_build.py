"""Both Dockerfiles really build, and each image runs its binary: scripts/build_image.sh with buildah (a stand-in
base where the official one cannot be pulled), then inside the plugin image `gpuplugin --help`, `run --help` and
`topo`, inside the extender image `gpu-extender serve --help`, `webhook --help` and a standalone extender answering
kube-scheduler's filter call; each image proven to lack the other half's libraries and command.

It takes minutes (ten or more on a loaded 2-core machine), so it runs only when asked: GPU_TOPOLOGY_IMAGE_TEST=1.
As root on Debian the script installs buildah (and debootstrap for the stand-in) from Debian's packages. What makes
it due is checked on every run, fast: the script records the fingerprint of the build's inputs after a build that
passed (deploy/image/fingerprint.py), and a change to those inputs fails the suite until the images are built again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.image import fingerprint
from deploy.image.source_url import source_url
from tests.deploy.rendering import ROOT


def test_images_were_built_from_the_current_inputs() -> None:
    """Fails, with the one line telling what to run, when an input of the image build changed since the last build
    that passed."""
    message = fingerprint.stale_message()
    assert message is None, message


def _inputs_copy(root: Path) -> Path:
    for name in (*fingerprint.FILES, "pyproject.toml"):
        shutil.copyfile(ROOT / name, root / name)
    shutil.copytree(ROOT / "deploy" / "image", root / "deploy" / "image",
                    ignore=shutil.ignore_patterns("__pycache__", fingerprint.RECORD.name))
    for lock in (ROOT / "deploy").glob("requirements-*.txt"):
        shutil.copyfile(lock, root / "deploy" / lock.name)
    for package in fingerprint.PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_fingerprint_follows_the_build_inputs_and_only_them(tmp_path: Path) -> None:
    """A new module, a dependency, a Dockerfile line or a build helper changes it; a module's contents or a tool's
    settings in pyproject.toml do not (the fast tests cover those); the recorded one is read back."""
    root = _inputs_copy(tmp_path)
    base = fingerprint.fingerprint(root)
    assert fingerprint.main(["--root", str(root), "--check"]) == 1  # nothing recorded in the copy yet
    assert fingerprint.write(root) == base and fingerprint.recorded(root) == base
    assert fingerprint.main(["--root", str(root), "--check"]) == 0
    pyproject = root / "pyproject.toml"
    (root / "gputopo" / "core" / "allocator.py").write_text("# changed\n", encoding="utf-8")
    pyproject.write_text(pyproject.read_text() + "\n[tool.example]\nsetting = 1\n")
    assert fingerprint.fingerprint(root) == base
    changes = [
        lambda: (root / "extender" / "new_module.py").write_text(""),
        lambda: (root / "Dockerfile.plugin").write_text((root / "Dockerfile.plugin").read_text() + "LABEL x=y\n"),
        lambda: pyproject.write_text(pyproject.read_text().replace('"click>=8.5,<9",', '"click>=8.5,<9", "rich",')),
        lambda: (root / "deploy" / "image" / "prune.py").write_text("# changed\n"),
        lambda: (root / "deploy" / "requirements-extender.txt").write_text("fastapi==1.0\n"),
        lambda: (root / "gpuplugin" / "sharing" / "config.py").rename(root / "gpuplugin" / "sharing" / "conf.py"),
    ]
    seen = {base}
    for change in changes:
        change()
        seen.add(fingerprint.fingerprint(root))
    assert len(seen) == len(changes) + 1
    assert "run `bash scripts/build_image.sh`" in (fingerprint.stale_message(root) or "")


@pytest.mark.skipif(os.environ.get("GPU_TOPOLOGY_IMAGE_TEST") != "1",
                    reason="builds the image with buildah (minutes): set GPU_TOPOLOGY_IMAGE_TEST=1 to run it")
@pytest.mark.timeout(3600)
def test_both_images_build_and_each_runs_its_binary() -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "build_image.sh")], cwd=ROOT, capture_output=True,
                            text=True, timeout=3500)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    for line in ("gpuplugin --help: ok", "gpuplugin run --help: ok", "gpuplugin topo (bundled DGX-1): ok",
                 "absent: fastapi uvicorn starlette", "no command: gpu-extender",
                 "gpu-extender serve --help: ok", "gpu-extender webhook --help: ok",
                 "standalone extender in the image: filter answered as kube-scheduler expects",
                 "absent: pynvml grpc google.protobuf watchdog", "no command: gpuplugin"):
        assert line in out, line
    assert len(re.findall(r"imports: \d+ modules of the product load after pruning", out)) == 2
    assert out.count(f"org.opencontainers.image.source={source_url()}\n") == 2
    for component in ("plugin", "extender"):
        assert re.search(rf"image \S+-{component}:dev: \d+ MB \(\d+ bytes; \d+ MB on top of the \d+ MB base\), "
                         r"built in \d+ s", out), component
    assert fingerprint.stale_message() is None, "the script records the inputs of the build that passed"


# Stand-ins for the stand-in base's tools: debootstrap leaves a file system mounted at the rootfs's proc (it mounts
# proc there while it runs; one it left made the script's first run fail); chroot answers ldconfig, and ensurepip
# with FAKE_CHROOT_RC; buildah has no base image and none to pull, and mounts a container at a plain directory.
FAKE_TOOLS = {
    "debootstrap": """#!/bin/bash
rootfs=${@: -2:1}
mkdir -p "$rootfs/proc" "$rootfs/sbin" "$rootfs/usr/share/doc/x" "$rootfs/var/lib/apt/lists"
mount -t tmpfs -o size=1m gpu-topology-test-proc "$rootfs/proc"
""",
    "chroot": """#!/bin/bash
case "$*" in *ensurepip*) exit "${FAKE_CHROOT_RC:-0}" ;; esac
""",
    "buildah": """#!/bin/bash
while [ $# -gt 0 ]; do case "$1" in --root|--runroot|--storage-driver) shift 2 ;; --*) shift ;; *) break ;; esac; done
case "$1" in
  inspect|pull) exit 1 ;;
  from) echo fake-ctr ;;
  mount) mkdir -p "$FAKE_MNT" && echo "$FAKE_MNT" ;;
esac
""",
}


def mounts_under(path: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(f"{path}/")]


def can_mount(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "probe", str(probe)], capture_output=True).returncode:
        return False
    subprocess.run(["umount", str(probe)], check=True)
    return True


@pytest.mark.parametrize("chroot_rc", [0, 1], ids=["whole run", "failing midway"])
def test_the_stand_in_base_leaves_no_mount_and_removes_its_rootfs(tmp_path: Path, chroot_rc: int) -> None:
    """A mount left inside the stand-in's rootfs neither stops the script at its clean-up (rm --one-file-system
    refuses to cross it) nor outlives a run that fails midway."""
    if os.geteuid() != 0 or shutil.which("mount") is None or not can_mount(tmp_path):
        pytest.skip("needs root and mount(2) to leave a file system mounted in the rootfs")
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, text in FAKE_TOOLS.items():
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    state = tmp_path / "state"
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", GPU_TOPOLOGY_IMAGE_STATE=str(state),
               FAKE_MNT=str(tmp_path / "container"), FAKE_CHROOT_RC=str(chroot_rc))
    try:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "build_image.sh"), "--only", "plugin",
                               "--repository", "localhost/gpu-topology-test"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        left = mounts_under(tmp_path)
    finally:
        for target in sorted(mounts_under(tmp_path), reverse=True):
            subprocess.run(["umount", "-l", target], check=False)
    out = done.stdout + done.stderr
    assert left == [], out[-3000:]
    if chroot_rc:
        assert done.returncode == 1, out[-3000:]
    else:
        # past the stand-in: the fake buildah then has no base image to measure, so the script stops there
        assert "stand-in base made in" in out, out[-3000:]
        assert not (state / "stand-in-rootfs").exists()
        assert (tmp_path / "container" / "usr" / "local" / "bin" / "python3").is_symlink()
