"""Which commands need which extra of the distribution, and one clear line when it is not installed.

`pip install gpu-topology-scheduling` (no extras) installs both console scripts but only the shared library's
dependencies; the device plugin needs `[plugin]`, the extender `[extender]`, the demo `[demo]`. Without this check a
command run there ends in a ModuleNotFoundError traceback from deep inside an import; with it, in one line naming
the missing module and the extra to install, exit 2. The modules are those pyproject.toml's extras provide (a test
keeps the two in step).
"""

from __future__ import annotations

import importlib.util
import sys

DISTRIBUTION = "gpu-topology-scheduling"
# extra -> the top-level modules its distributions provide that the product imports.
_PLUGIN = ("grpc", "google.protobuf", "pynvml", "watchdog")
_EXTENDER = ("fastapi", "uvicorn", "httptools", "uvloop")
EXTRAS: dict[str, tuple[str, ...]] = {
    "plugin": _PLUGIN,
    "extender": _EXTENDER,
    "demo": (*_PLUGIN, *_EXTENDER, "httpx"),  # [demo] is both halves and the simulator's HTTP client
}
EXIT_MISSING_EXTRA = 2  # click's code for a usage error: the command cannot run as installed


def missing(extra: str) -> str | None:
    """The first module of `extra` that cannot be found, None when all can. Finds, never imports (cheap, no side
    effects); a parent package that is absent makes its submodule missing."""
    for name in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # an absent parent package, or a module set to None in sys.modules
            found = False
        if not found:
            return name
    return None


def message(command: str, extra: str, module: str) -> str:
    return (f"{command} needs the {extra!r} extra (missing module {module}): "
            f"pip install '{DISTRIBUTION}[{extra}]'")


def require(command: str, extra: str) -> None:
    """Exit 2 with one line on stderr when `extra` is not installed."""
    module = missing(extra)
    if module is not None:
        print(message(command, extra, module), file=sys.stderr)
        raise SystemExit(EXIT_MISSING_EXTRA)
