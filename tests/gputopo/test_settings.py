"""Both binaries' settings through their real command lines (gputopo.settings).

--help shows each setting's type, default and environment variables, all taken from the model; --print-config
prints every value the model has a default for; a file that is missing, a directory or unreadable exits 2 naming
the path, in every subcommand that reads one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import structlog
from click.testing import CliRunner

from extender.cli import main as extender_main
from extender.config import SETTINGS as EXTENDER_SETTINGS
from gpuplugin.cli import main as plugin_main
from gpuplugin.config import SETTINGS as PLUGIN_SETTINGS
from gputopo.settings import SettingsLoader

BINARIES: dict[str, tuple[click.Group, str, SettingsLoader[Any]]] = {
    "gpuplugin": (plugin_main, "run", PLUGIN_SETTINGS),
    "gpu-extender": (extender_main, "serve", EXTENDER_SETTINGS),
}
# Whatever the machine running the tests has set must not leak into them.
CLEAN = {name: None for name in os.environ if name.startswith(("GPUPLUGIN_", "GPU_EXTENDER_")) or name == "NODE_NAME"}
WIDE = {"terminal_width": 400, "max_content_width": 400}  # one line per option


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # `gpuplugin` configures logging before its subcommand parses


def _invoke(binary: str, args: list[str], env: dict[str, str] | None = None) -> click.testing.Result:
    main, _, _ = BINARIES[binary]
    return CliRunner().invoke(main, args, env={**CLEAN, **(env or {})}, catch_exceptions=False, **WIDE)


def _help_rows(binary: str) -> dict[str, str]:
    _, command, _ = BINARIES[binary]
    result = _invoke(binary, [command, "--help"])
    assert result.exit_code == 0, result.output
    rows: dict[str, str] = {}
    option = None
    for line in result.output.split("Options:")[1].splitlines():
        if line.strip().startswith("--"):
            option = line.split()[0].rstrip(",")  # "--flag, --alias TYPE"
            rows[option] = line.strip()
        elif option and line.startswith("   "):  # a long option's help goes on the next line
            rows[option] += " " + line.strip()
        else:
            option = None
    return rows


HELP_SHOWS = {
    "gpuplugin": [
        "--device-plugin-dir PATH", "--topology FILE", "--device-list-strategy [envvar|cdi-cri|cdi-annotations|cdi]",
        "--device-id-strategy [uuid|index]", "--metrics-port INTEGER", "--health-probe-interval FLOAT",
        "--log-level [debug|info|warning|error]", "--health-recovery SECONDS|never", "--publish / --no-publish",
        "[env var: GPUPLUGIN_NODE_NAME, NODE_NAME]", "[env var: GPUPLUGIN_METRICS_PORT; default: 8080]",
        "default: 13,31,43,45,68,109]", "default: 5.0]", "default: 60.0]", "default: auto]",
        "[env var: GPUPLUGIN_CONFIG]",
    ],
    "gpu-extender": [
        "--port INTEGER", "--reservation-timeout FLOAT", "--kubeconfig FILE", "--inventory FILE", "--tls-cert FILE",
        "--island-spare INTEGER", "--log-level [debug|info|warning|error]",
        "--allow-insecure-remote / --no-allow-insecure-remote",
        "[env var: GPU_EXTENDER_RESERVATION_TIMEOUT; default: 60.0]", "default: 10485760]",
        "[env var: GPU_EXTENDER_CONFIG]",
    ],
}


@pytest.mark.parametrize("binary", sorted(BINARIES))
def test_help_shows_types_defaults_and_environment_from_the_model(binary: str) -> None:
    rows = _help_rows(binary)
    text = "\n".join(rows.values())
    for expected in HELP_SHOWS[binary]:
        assert expected in text, expected
    _, _, loader = BINARIES[binary]
    for setting in loader.settings:
        row = rows[f"--{setting.flag}"]
        assert setting.env[0] in row
        default = setting.info.get_default()
        if default is not None:
            assert "default: " in row, row
        if not setting.is_bool and setting.info.annotation not in (str, str | None):
            assert f"--{setting.flag} TEXT" not in row, row


@pytest.mark.parametrize("binary", sorted(BINARIES))
def test_print_config_prints_every_setting_and_no_null_where_there_is_a_default(binary: str) -> None:
    _, command, loader = BINARIES[binary]
    result = _invoke(binary, [command, "--print-config"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    assert list(printed) == [s.key for s in loader.settings]
    for setting in loader.settings:
        if setting.info.get_default() is not None:
            assert printed[setting.key] is not None, setting.key


def _bad_path(tmp_path: Path, kind: str) -> Path:
    if kind == "missing":
        return tmp_path / "absent.yaml"
    if kind == "directory":
        return tmp_path
    path = tmp_path / "secret.yaml"
    path.write_text("x: 1\n")
    path.chmod(0)
    return path


FILE_ARGUMENTS = {
    "run --topology": ("gpuplugin", ["run", "--topology", "{}"], {}),
    "run GPUPLUGIN_TOPOLOGY": ("gpuplugin", ["run"], {"GPUPLUGIN_TOPOLOGY": "{}"}),
    "run --config": ("gpuplugin", ["run", "--config", "{}"], {}),
    "run GPUPLUGIN_CONFIG": ("gpuplugin", ["run"], {"GPUPLUGIN_CONFIG": "{}"}),
    "topo FILE": ("gpuplugin", ["topo", "{}"], {}),
    "plan --topology": ("gpuplugin", ["plan", "--topology", "{}", "--size", "1"], {}),
    "record --replay": ("gpuplugin", ["record", "--replay", "{}"], {}),
    "serve --inventory": ("gpu-extender", ["serve", "--inventory", "{}"], {}),
    "serve --kubeconfig": ("gpu-extender", ["serve", "--kubeconfig", "{}"], {}),
    "serve GPU_EXTENDER_KUBECONFIG": ("gpu-extender", ["serve"], {"GPU_EXTENDER_KUBECONFIG": "{}"}),
    "serve --tls-cert": ("gpu-extender", ["serve", "--tls-cert", "{}", "--tls-key", "{}"], {}),
    "serve --tls-client-ca": ("gpu-extender", ["serve", "--tls-client-ca", "{}"], {}),
    "serve --config": ("gpu-extender", ["serve", "--config", "{}"], {}),
    "serve GPU_EXTENDER_CONFIG": ("gpu-extender", ["serve"], {"GPU_EXTENDER_CONFIG": "{}"}),
}


def _exits_2_naming(path: Path, case: str) -> None:
    binary, args, env = FILE_ARGUMENTS[case]
    result = _invoke(binary, [a.format(path) for a in args], {k: v.format(path) for k, v in env.items()})
    assert result.exit_code == 2, result.output
    assert str(path) in result.output


@pytest.mark.parametrize("kind", ["missing", "directory"])
@pytest.mark.parametrize("case", sorted(FILE_ARGUMENTS))
def test_a_bad_file_exits_2_naming_the_path(tmp_path: Path, case: str, kind: str) -> None:
    _exits_2_naming(_bad_path(tmp_path, kind), case)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_file_exits_2_naming_the_path(tmp_path: Path) -> None:
    for case in sorted(FILE_ARGUMENTS):
        _exits_2_naming(_bad_path(tmp_path, "unreadable"), case)
