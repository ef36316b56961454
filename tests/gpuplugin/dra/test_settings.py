"""`gpuplugin dra` settings through its real command line (gputopo.settings): flags, GPUPLUGIN_DRA_* and NODE_NAME,
the YAML file, --print-config, and bad values exiting 2 naming the setting and where it came from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpuplugin.commands.dra import command
from gpuplugin.dra.settings import SETTINGS

CLEAN = {name: None for name in os.environ if name.startswith("GPUPLUGIN_") or name == "NODE_NAME"}


def invoke(*args: str, **env: str) -> Result:
    return CliRunner().invoke(command, list(args), env={**CLEAN, **env}, catch_exceptions=False,
                              terminal_width=400, max_content_width=400)


def resolved(*args: str, **env: str) -> dict:
    result = invoke(*args, "--print-config", **env)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_help_shows_every_setting_with_its_environment_and_default() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for setting in SETTINGS.settings:
        assert f"--{setting.flag}" in result.output and setting.env[0] in result.output
    for shown in ("[env var: GPUPLUGIN_DRA_NODE_NAME, NODE_NAME]", "--republish / --no-republish",
                  "--min-publish-interval FLOAT", "--set-sizes SIZE,...", "--log-level [debug|info|warning|error]",
                  "default: 2,4,8,16]", "[env var: GPUPLUGIN_DRA_CONFIG]"):
        assert shown in result.output, shown


def test_flag_beats_environment_beats_file_and_node_name_comes_from_the_downward_api(tmp_path: Path) -> None:
    config = tmp_path / "dra.yaml"
    config.write_text("set-sizes: 2,4\nmin_publish_interval: 1.5\nmetrics-port: 9000\n")
    got = resolved("--metrics-port", "0", NODE_NAME="node-a", GPUPLUGIN_DRA_CONFIG=str(config),
                   GPUPLUGIN_DRA_MIN_PUBLISH_INTERVAL="0.5", GPUPLUGIN_DRA_REPUBLISH="false")
    assert list(got) == [s.key for s in SETTINGS.settings]
    assert (got["node_name"], got["set_sizes"], got["min_publish_interval"], got["metrics_port"]) == (
        "node-a", [2, 4], 0.5, 0)
    assert got["republish"] is False and got["plugin_dir"] is None
    assert resolved(NODE_NAME="node-a", GPUPLUGIN_DRA_NODE_NAME="node-b")["node_name"] == "node-b"
    assert got["reconcile_interval"] == 60.0  # the kubelet's own unprepare loop's period
    assert resolved("--reconcile-interval", "5", NODE_NAME="n")["reconcile_interval"] == 5.0


@pytest.mark.parametrize(("args", "env", "message"), [
    ([], {}, "node-name is required (--node-name, GPUPLUGIN_DRA_NODE_NAME or NODE_NAME)"),
    ([], {"NODE_NAME": "Not_A_Node"}, "invalid node_name from NODE_NAME"),
    ([], {"NODE_NAME": "n", "GPUPLUGIN_DRA_SET_SIZES": "2,64"},
     "invalid set_sizes from GPUPLUGIN_DRA_SET_SIZES: set sizes must be within 2..16, got [64]"),
    (["--set-sizes", "2,four"], {"NODE_NAME": "n"}, "not a comma-separated list of integers"),
    (["--min-publish-interval", "-1"], {"NODE_NAME": "n"}, "invalid min_publish_interval from --min-publish-interval"),
    (["--reconcile-interval", "0"], {"NODE_NAME": "n"}, "invalid reconcile_interval from --reconcile-interval"),
    ([], {"NODE_NAME": "n", "GPUPLUGIN_DRA_RECONCILE_INTERVAL": "86400"},
     "invalid reconcile_interval from GPUPLUGIN_DRA_RECONCILE_INTERVAL"),
    (["--topology", "/nonexistent/topo.txt"], {"NODE_NAME": "n"}, "file '/nonexistent/topo.txt' does not exist"),
    (["--driver-name", "UPPER.case"], {"NODE_NAME": "n"}, "invalid driver_name from --driver-name"),
])
def test_bad_settings_exit_2_naming_the_setting_and_its_source(args: list[str], env: dict[str, str],
                                                               message: str) -> None:
    result = invoke(*args, "--print-config", **env)
    assert result.exit_code == 2 and message in result.output, result.output
