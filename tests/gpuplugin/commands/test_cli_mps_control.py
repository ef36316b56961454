"""`gpuplugin mps-control` settings through the one loader (flag > GPUPLUGIN_MPS_CONTROL_<FLAG> > YAML > default),
bad values exit 2 naming the setting and its source, and `gpuplugin run --mps-daemons` takes only its two modes."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from gpuplugin.cli import main


def _invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, env=env or {}, catch_exceptions=False)
    return result.exit_code, result.output


def test_settings_resolve_flag_env_file_default(tmp_path: Path) -> None:
    config = tmp_path / "control.yaml"
    config.write_text("mps-root: /run/from-file\npoll_interval: 7\nprobe-interval: 3\n")
    code, out = _invoke(["mps-control", "--config", str(config), "--poll-interval", "0.5", "--print-config"],
                        {"GPUPLUGIN_MPS_CONTROL_PROBE_INTERVAL": "1.5"})
    assert code == 0, out
    resolved = json.loads(out)
    assert resolved["mps_root"] == "/run/from-file" and resolved["poll_interval"] == 0.5
    assert resolved["probe_interval"] == 1.5 and resolved["mps_control"] == "nvidia-cuda-mps-control"
    assert resolved["metrics_port"] == 8081


def test_bad_values_exit_2_naming_them(tmp_path: Path) -> None:
    code, out = _invoke(["mps-control", "--probe-interval", "-1"])
    assert code == 2 and "invalid probe_interval from --probe-interval" in out
    code, out = _invoke(["mps-control"], {"GPUPLUGIN_MPS_CONTROL_METRICS_PORT": "70000"})
    assert code == 2 and "GPUPLUGIN_MPS_CONTROL_METRICS_PORT" in out
    config = tmp_path / "control.yaml"
    config.write_text("mps-daemons: external\n")  # a plugin setting in the control daemon's file
    code, out = _invoke(["mps-control", "--config", str(config)])
    assert code == 2 and "unknown setting 'mps-daemons'" in out


def test_run_takes_the_two_mps_daemon_modes() -> None:
    code, out = _invoke(["run", "--mps-daemons", "external", "--print-config"])
    assert code == 0 and json.loads(out)["mps_daemons"] == "external"
    code, out = _invoke(["run", "--print-config"])
    assert json.loads(out)["mps_daemons"] == "in-plugin"  # unchanged for existing installs
    code, out = _invoke(["run", "--mps-daemons", "sidecar"])
    assert code == 2 and "mps_daemons" in out
