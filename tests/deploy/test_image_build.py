"""Both Dockerfiles really build, and each image runs its binary: scripts/build_image.sh with buildah (a stand-in
base where the official one cannot be pulled), then inside the plugin image `gpuplugin --help`, `run --help` and
`topo`, inside the extender image `gpu-extender serve --help`, `webhook --help` and a standalone extender answering
kube-scheduler's filter call; each image proven to lack the other half's libraries and command.

It takes minutes (ten or more on a loaded 2-core machine), so it runs only when asked: GPU_TOPOLOGY_IMAGE_TEST=1.
As root on Debian the script installs buildah (and debootstrap for the stand-in) from Debian's packages.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from deploy.image.source_url import source_url
from tests.deploy.rendering import ROOT

pytestmark = [
    pytest.mark.skipif(os.environ.get("GPU_TOPOLOGY_IMAGE_TEST") != "1",
                       reason="builds the image with buildah (minutes): set GPU_TOPOLOGY_IMAGE_TEST=1 to run it"),
    pytest.mark.timeout(3600),
]


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
