"""The project's repository URL, read from the one place it is written: pyproject.toml's [project.urls] Source.

The image's OCI source label comes from it: `python3 deploy/image/source_url.py` prints it for
`--build-arg SOURCE_URL=...`, and the build stage runs `source_url.py --check "$SOURCE_URL"`, which stops the build
when the argument is missing or names anything else.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def source_url(pyproject: Path = PYPROJECT) -> str:
    with pyproject.open("rb") as f:
        return str(tomllib.load(f)["project"]["urls"]["Source"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    parser.add_argument("--check", metavar="URL", help="exit 1 unless URL is the project's source URL")
    args = parser.parse_args(argv)
    want = source_url(args.pyproject)
    if args.check is None:
        print(want)
        return 0
    if args.check != want:
        print(f"the OCI source label must be {want} (pyproject.toml [project.urls] Source): "
              f"pass --build-arg SOURCE_URL={want}; got {args.check!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
