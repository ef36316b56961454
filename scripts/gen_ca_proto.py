"""Regenerate sim/ca_provider/proto/ from proto/autoscaler/ (the Cluster Autoscaler's externalgrpc protocol and
the Kubernetes protos it imports) with grpcio-tools.

Unlike scripts/gen_proto.py, an include-root mapping cannot make the imports package-absolute: the Kubernetes
files live under `k8s.io/`, which protoc turns into the module path `k8s.io.api...`, not a Python package. So
protoc writes into a scratch directory and this script moves `k8s.io/` to `k8s_io/` and rewrites the generated
imports to `sim.ca_provider.proto...`. Only externalgrpc.proto has services: gRPC stubs are generated for it
alone. The output is kept in git; tests/sim/test_ca_provider.py regenerates into a temporary directory and
compares bytes.

    python scripts/gen_ca_proto.py            # rewrite the committed files
    python scripts/gen_ca_proto.py --out DIR  # write the tree under DIR instead
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto" / "autoscaler"
PACKAGE = "sim/ca_provider/proto"
MODULE = PACKAGE.replace("/", ".")
SERVICE = "externalgrpc.proto"


def _protos() -> list[str]:
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))


def _protoc(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", *args],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed ({done.returncode}): {done.stderr.strip()}")


def _rewrite(text: str) -> str:
    text = re.sub(r"^from k8s\.io\.", f"from {MODULE}.k8s_io.", text, flags=re.M)
    return re.sub(r"^import externalgrpc_pb2 as ", f"from {MODULE} import externalgrpc_pb2 as ", text, flags=re.M)


def generate(out_root: Path) -> list[Path]:
    """Write the generated tree under `out_root` (normally the repository root); return the files written."""
    package = out_root / PACKAGE
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="gen-ca-proto-") as scratch:
        _protoc(f"--python_out={scratch}", *_protos())
        _protoc(f"--grpc_python_out={scratch}", SERVICE)
        for path in sorted(Path(scratch).rglob("*.py")):
            rel = re.sub(r"^k8s[./]io/", "k8s_io/", path.relative_to(scratch).as_posix())
            dest = package / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(_rewrite(path.read_text()))
            written.append(dest)
    directories = {package}
    for path in written:
        directories.update(d for d in path.parents if d.is_relative_to(package))
    for directory in sorted(directories):
        init = directory / "__init__.py"
        sub = directory.relative_to(package).as_posix()
        what = "the Cluster Autoscaler's externalgrpc protocol" if sub == "." else f"Kubernetes' {sub[7:] or 'protos'}"
        init.write_text(f'"""Generated code of {what} (scripts/gen_ca_proto.py)."""\n')
        written.append(init)
    return sorted(written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write sim/ca_provider/proto/ under")
    args = parser.parse_args()
    target = args.out / PACKAGE
    if target.exists():
        shutil.rmtree(target)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
