"""The project's repository URL, read from the one place it is written: pyproject.toml's [project.urls] Source.

The image's OCI source label comes from the SOURCE_URL build argument, whose default in each Dockerfile is that URL
(a test keeps them equal; a Dockerfile cannot read a file for a label). A fork passes its own repository:
`--build-arg SOURCE_URL=https://github.com/someone/fork`. The build stage runs `source_url.py --check "$SOURCE_URL"`,
which accepts an empty value (the default applies) or any well-formed https URL, and stops the build on anything else,
so a label is never garbage. `python3 deploy/image/source_url.py` prints the project's URL.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
_HOST = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)+$")


def source_url(pyproject: Path = PYPROJECT) -> str:
    with pyproject.open("rb") as f:
        return str(tomllib.load(f)["project"]["urls"]["Source"])


def problem(url: str) -> str | None:
    """Why `url` is no repository address for a public label (None when it is one): https, a dotted host name, no
    credentials, no spaces, query or fragment."""
    if any(c.isspace() for c in url) or not url.isprintable():
        return "it holds spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"it does not parse ({e})"
    if parts.scheme != "https":
        return "it is not an https:// URL"
    if parts.username is not None or parts.password is not None:
        return "it holds credentials, which a public label must not"
    if not parts.hostname or not _HOST.match(parts.hostname):
        return "it names no host such as github.com"
    if parts.query or parts.fragment or (port is not None and not 0 < port < 65536):
        return "it has a query, fragment or bad port"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    parser.add_argument("--check", metavar="URL",
                        help="exit 1 unless URL is empty (the project's URL applies) or a well-formed https URL")
    args = parser.parse_args(argv)
    default = source_url(args.pyproject)
    if args.check is None:
        print(default)
        return 0
    if args.check == "":
        print(f"OCI source label: {default} (pyproject.toml [project.urls] Source)")
        return 0
    why = problem(args.check)
    if why:
        print(f"SOURCE_URL must be an https URL of the repository, such as {default}; got {args.check!r}: {why}",
              file=sys.stderr)
        return 1
    print(f"OCI source label: {args.check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
