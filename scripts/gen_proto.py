"""Regenerate gpuplugin/proto/ from proto/*.proto with grpcio-tools.

The include root maps `gpuplugin/proto` onto `proto/`, so protoc itself writes package-absolute imports
(`from gpuplugin.proto.deviceplugin.v1beta1 import api_pb2`) and no post-processing is needed. No .pyi stubs: the
repository's ruff config only exempts the generated .py files. The output is kept in git;
tests/gpuplugin/proto/test_deviceplugin.py regenerates into a temporary directory and compares bytes, so a changed
.proto without a regeneration fails CI.

    python scripts/gen_proto.py            # rewrite the committed files
    python scripts/gen_proto.py --out DIR  # write the tree under DIR instead
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = "gpuplugin/proto"
PROTOS = (
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "pluginregistration/v1/api.proto",
    "dra/v1/api.proto",
    "drahealth/v1alpha1/api.proto",
)

_INIT_DOCS = {
    "": '"""Generated kubelet API code (scripts/gen_proto.py); short aliases for the two APIs."""\n\n'
    "from gpuplugin.proto.deviceplugin.v1beta1 import api_pb2 as deviceplugin_pb2\n"
    "from gpuplugin.proto.deviceplugin.v1beta1 import api_pb2_grpc as deviceplugin_pb2_grpc\n"
    "from gpuplugin.proto.podresources.v1 import api_pb2 as podresources_pb2\n"
    "from gpuplugin.proto.podresources.v1 import api_pb2_grpc as podresources_pb2_grpc\n\n"
    '__all__ = ["deviceplugin_pb2", "deviceplugin_pb2_grpc", "podresources_pb2", "podresources_pb2_grpc"]\n',
    "deviceplugin": '"""Kubelet device plugin API (generated)."""\n',
    "deviceplugin/v1beta1": '"""Kubelet device plugin API v1beta1 (generated)."""\n',
    "podresources": '"""Kubelet pod resources API (generated)."""\n',
    "podresources/v1": '"""Kubelet pod resources API v1 (generated)."""\n',
    "pluginregistration": '"""Kubelet plugin registration API (generated)."""\n',
    "pluginregistration/v1": '"""Kubelet plugin registration API v1 (generated)."""\n',
    "dra": '"""Kubelet DRA plugin API (generated)."""\n',
    "dra/v1": '"""Kubelet DRA plugin API v1 (generated)."""\n',
    "drahealth": '"""Kubelet DRA resource health API (generated)."""\n',
    "drahealth/v1alpha1": '"""Kubelet DRA resource health API v1alpha1 (generated)."""\n',
}


def generate(out_root: Path) -> list[Path]:
    """Write the generated tree under `out_root` (normally the repository root); return the files written."""
    out_root.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PACKAGE}={PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"{PACKAGE}/{p}" for p in PROTOS),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed ({done.returncode}): {done.stderr.strip()}")
    written = []
    for sub, text in _INIT_DOCS.items():
        path = out_root / PACKAGE / sub / "__init__.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    for proto in PROTOS:
        stem = out_root / PACKAGE / proto.removesuffix(".proto")
        written += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2_grpc.py")]
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write gpuplugin/proto/ under")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
