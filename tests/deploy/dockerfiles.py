"""Reading our Dockerfiles and .dockerignore the way `docker build` does, for the image tests.

Only the Dockerfile syntax the image uses is understood (FROM ... AS, COPY src dst, COPY --from); the
.dockerignore matcher follows Docker's rules (patterns relative to the context root, `**` for any number of
directories, `!` re-includes, the last matching pattern wins, a file is excluded when it or a parent matches).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.rendering import ROOT

# One image per component: the device plugin's (gpuplugin) and the extender's (gpu-extender, webhook included).
DOCKERFILES = {"plugin": ROOT / "Dockerfile.plugin", "extender": ROOT / "Dockerfile.extender"}


@dataclass(frozen=True)
class Copy:
    stage: str
    sources: tuple[str, ...]
    destination: str
    from_stage: str | None


def logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined and comments dropped."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def copies(dockerfile: Path) -> list[Copy]:
    found: list[Copy] = []
    stage = ""
    for line in logical_lines(dockerfile.read_text()):
        words = shlex.split(line)
        instruction = words[0].upper()
        if instruction == "FROM":
            stage = words[3] if len(words) >= 4 and words[2].upper() == "AS" else words[1]
        elif instruction == "COPY":
            flags = [w for w in words[1:] if w.startswith("--")]
            paths = [w for w in words[1:] if not w.startswith("--")]
            from_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            found.append(Copy(stage, tuple(paths[:-1]), paths[-1], from_stage))
    return found


def run_commands(dockerfile: Path) -> list[tuple[str, str]]:
    """(stage, shell command) of every RUN, with RUN flags such as --mount removed."""
    out: list[tuple[str, str]] = []
    stage = ""
    for line in logical_lines(dockerfile.read_text()):
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            words = rest.split()
            stage = words[2] if len(words) >= 3 and words[1].upper() == "AS" else words[0]
        elif instruction.upper() == "RUN":
            out.append((stage, re.sub(r"^(--\S+\s+)+", "", rest.strip())))
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^/]")
            i += 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("^" + "".join(parts) + "$")


def ignore_rules(context: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(re-include?, regex) per .dockerignore line."""
    path = context / ".dockerignore"
    rules = []
    for raw in path.read_text().splitlines() if path.is_file() else []:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        rules.append((negate, _pattern_regex(pattern.strip("/"))))
    return rules


def is_ignored(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = relative.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.match(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def build_context(context: Path) -> set[str]:
    """Every file `docker build context` would send (relative POSIX paths)."""
    rules = ignore_rules(context)
    skip_dirs = {".git", ".venv", "node_modules"}
    files = set()
    for path in context.rglob("*"):
        relative = path.relative_to(context)
        if relative.parts[0] in skip_dirs or not path.is_file():
            continue
        if not is_ignored(relative.as_posix(), rules):
            files.add(relative.as_posix())
    return files
