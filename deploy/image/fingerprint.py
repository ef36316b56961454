"""The fingerprint of what the images are built from, and the one of the last build that passed.

The full image build (scripts/build_image.sh, buildah) takes minutes, so the suite does not run it; instead a fast
test compares the fingerprint of the build's inputs with the one recorded in deploy/image/built-from.sha256, which
scripts/build_image.sh rewrites after both images built and passed their smoke tests. A change to an input then
fails the suite until someone builds the images again.

Inputs: the Dockerfiles and .dockerignore, the build helpers in deploy/image/, the image locks
(deploy/requirements-*.txt), the parts of pyproject.toml that shape the wheel (build system, project metadata,
dependencies, extras, scripts, entry points, package discovery; not the tools' settings), and the package layout:
the sorted module paths of the product (not their contents, which the fast tests cover).

    python3 deploy/image/fingerprint.py            print the inputs' fingerprint
    python3 deploy/image/fingerprint.py --check    exit 1, with one line, unless it is the recorded one
    python3 deploy/image/fingerprint.py --write [--built-from FP]
                                                   record it (scripts/build_image.sh, after a build that passed,
                                                   with the fingerprint it took before building: refused, exit 1,
                                                   when the inputs changed meanwhile)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = Path("deploy/image/built-from.sha256")
PACKAGES = ("gputopo", "gpuplugin", "extender", "sim")
FILES = ("Dockerfile.plugin", "Dockerfile.extender", ".dockerignore")
PYPROJECT_TABLES = ("build-system", "project", "tool.setuptools")


def inputs(root: Path = ROOT) -> dict[str, str]:
    """Each input's name and its digest (the layout and pyproject's parts as canonical text)."""
    files = [root / name for name in FILES]
    files += sorted(p for p in (root / "deploy" / "image").iterdir()
                    if p.is_file() and p.name != RECORD.name and p.suffix != ".pyc")
    files += sorted((root / "deploy").glob("requirements-*.txt"))
    found = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    with (root / "pyproject.toml").open("rb") as f:
        pyproject = tomllib.load(f)
    shaping = {}
    for table in PYPROJECT_TABLES:
        value: object = pyproject
        for key in table.split("."):
            value = value.get(key, {}) if isinstance(value, dict) else {}
        shaping[table] = value
    found["pyproject.toml (wheel-shaping tables)"] = _digest(json.dumps(shaping, sort_keys=True))
    layout = sorted(p.relative_to(root).as_posix() for package in PACKAGES for p in (root / package).rglob("*.py")
                    if "__pycache__" not in p.parts)
    found["package layout"] = _digest("\n".join(layout))
    return found


def fingerprint(root: Path = ROOT) -> str:
    return _digest("\n".join(f"{name} {digest}" for name, digest in sorted(inputs(root).items())))


def recorded(root: Path = ROOT) -> str | None:
    path = root / RECORD
    if not path.exists():
        return None
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return lines[0].strip() if lines else None


def write(root: Path = ROOT) -> str:
    value = fingerprint(root)
    (root / RECORD).write_text("# Inputs of the last image build that passed (deploy/image/fingerprint.py); "
                               "scripts/build_image.sh rewrites it.\n" + value + "\n")
    return value


def stale_message(root: Path = ROOT) -> str | None:
    """One line when the images were not built from the current inputs, else None."""
    want, have = fingerprint(root), recorded(root)
    if want == have:
        return None
    return (f"the image inputs (Dockerfiles, deploy/image/, locks, pyproject.toml, package layout) changed since the "
            f"last image build that passed ({RECORD}): run `bash scripts/build_image.sh`, which records the new "
            f"fingerprint when both images build and pass")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="exit 1 unless the inputs are those of the last build")
    action.add_argument("--write", action="store_true", help="record the inputs' fingerprint")
    parser.add_argument("--built-from", metavar="FP", help="with --write: the fingerprint taken before the build")
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    if args.write:
        if args.built_from and args.built_from != fingerprint(args.root):
            print(f"the image inputs changed during the build: {RECORD} not rewritten; build again", file=sys.stderr)
            return 1
        print(f"image inputs recorded in {RECORD}: {write(args.root)}")
    elif args.check:
        message = stale_message(args.root)
        if message:
            print(message, file=sys.stderr)
            return 1
    else:
        print(fingerprint(args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
