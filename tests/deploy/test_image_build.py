"""The Dockerfile really builds, and both binaries run inside the image: scripts/build_image.sh with buildah (a
stand-in base where the official one cannot be pulled), then `gpuplugin --help`, `gpu-extender serve --help` and a
standalone extender answering kube-scheduler's filter call, all inside the image.

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


def test_image_builds_and_both_binaries_run_inside_it() -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "build_image.sh")], cwd=ROOT, capture_output=True,
                            text=True, timeout=3500)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "gpuplugin --help: ok" in out and "gpu-extender serve --help: ok" in out
    assert "standalone extender in the image: filter answered as kube-scheduler expects" in out
    assert re.search(r"imports: \d+ modules of the product load after pruning", out)
    assert f"org.opencontainers.image.source={source_url()}\n" in out
    assert re.search(r"image \S+: \d+ MB \(\d+ bytes; \d+ MB on top of the \d+ MB base\), built in \d+ s", out)
