"""Which commands need which extra of the distribution, and one clear line when it is not installed.

`pip install gpu-topology-scheduling` (no extras) installs both console scripts but only the shared library's
dependencies; the device plugin needs `[plugin]`, the extender `[extender]`, the demo `[demo]`. Without this check a
command run there ends in a ModuleNotFoundError traceback from deep inside an import; with it, in one line naming
the missing module and the extra to install, exit 2, and the group's --help marks the command with what to
install (`stand_in`, used by both binaries' groups). The modules are those pyproject.toml's extras provide (a test
keeps the two in step).
"""

from __future__ import annotations

import importlib.util

import click

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


def stand_in(program: str, name: str, extra: str | None) -> click.Command | None:
    """What a click group returns for its subcommand `name` when `extra` (None: it needs none) is not installed,
    else None (load the real one). Both binaries' groups use it, so their --help marks a command the same way."""
    module = missing(extra) if extra else None
    if extra is None or module is None:
        return None
    line = message(f"{program} {name}", extra, module)

    def fail() -> None:
        click.echo(line, err=True)
        raise SystemExit(EXIT_MISSING_EXTRA)

    # Listed in the group's --help with what to install; any arguments, --help included, get the one line (the
    # command's own help needs its imports).
    return click.Command(name, callback=fail, add_help_option=False,
                         short_help=f"(not installed: pip install '{DISTRIBUTION}[{extra}]')",
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
