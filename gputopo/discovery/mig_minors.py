"""`/proc/driver/nvidia-caps/mig-minors`: which /dev/nvidia-caps/nvidia-cap<N> node opens a MIG instance.

Why: a container given a MIG device needs, besides the parent's /dev/nvidiaN, the capability nodes of its GPU
instance and compute instance (`gpu<minor>/gi<G>/access` and `gpu<minor>/gi<G>/ci<C>/access`); the driver lists
every possible one, with its device minor, in this file (NVIDIA's plugin reads it the same way:
internal/rm/nvml_devices.go GetPaths). Lines are `<name> <minor>`; the file lists config, monitor and gpu0..31 x
gi0..14 x ci0..7 whether MIG is enabled or not (tests/fixtures/recordings/h200-mig-disabled/).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CAPS_DEVICE_DIR = "/dev/nvidia-caps"
_LINE = re.compile(r"^(config|monitor|gpu[0-9]{1,4}/gi[0-9]{1,4}(?:/ci[0-9]{1,4})?/access)\s+([0-9]{1,9})$")
_MAX_LINES = 100_000  # the driver writes ~4.3k; anything far beyond is not this file


@dataclass(frozen=True)
class MigMinors:
    """Parsed mig-minors: capability name -> device minor, and the lines that were not understood."""

    entries: dict[str, int]
    bad_lines: tuple[str, ...] = ()

    def gpu_instance_minor(self, gpu_minor: int, gi: int) -> int | None:
        return self.entries.get(f"gpu{gpu_minor}/gi{gi}/access")

    def compute_instance_minor(self, gpu_minor: int, gi: int, ci: int) -> int | None:
        return self.entries.get(f"gpu{gpu_minor}/gi{gi}/ci{ci}/access")

    def device_nodes(self, gpu_minor: int, gi: int, ci: int) -> tuple[str, ...] | None:
        """The two capability nodes a container needs for one MIG device; None when the file does not list them."""
        g = self.gpu_instance_minor(gpu_minor, gi)
        c = self.compute_instance_minor(gpu_minor, gi, ci)
        if g is None or c is None:
            return None
        return (f"{CAPS_DEVICE_DIR}/nvidia-cap{g}", f"{CAPS_DEVICE_DIR}/nvidia-cap{c}")


def parse_mig_minors(text: str) -> MigMinors:
    """Read the file's text. Lines that do not have the driver's shape are kept aside (and named by the caller's
    log), never guessed at; a name listed twice keeps its first minor and counts as a bad line."""
    entries: dict[str, int] = {}
    bad: list[str] = []
    for n, raw in enumerate(text.splitlines()):
        if n >= _MAX_LINES:
            bad.append(f"... {len(text.splitlines()) - n} more lines not read")
            break
        line = raw.strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None or m[1] in entries:
            bad.append(line[:200])
            continue
        entries[m[1]] = int(m[2])
    return MigMinors(entries, tuple(bad))


def format_mig_minors(entries: dict[str, int]) -> str:
    """The file's text for `entries` (what a replay answers for the recorded lines)."""
    return "".join(f"{name} {minor}\n" for name, minor in entries.items())
