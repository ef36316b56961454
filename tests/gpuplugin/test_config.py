"""`gpuplugin run` settings: flag > environment > YAML file > default, and invalid values exit 2 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuplugin.commands.run import command
from tests.gpuplugin.deviceplugin.conftest import DGX1


def _resolved(args: list[str], env: dict[str, str] | None = None) -> dict:
    result = CliRunner().invoke(command, [*args, "--print-config"], env=env or {}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _error(args: list[str], env: dict[str, str] | None = None) -> str:
    result = CliRunner().invoke(command, args, env=env or {}, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    return result.output


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "plugin.yaml"
    path.write_text(
        "device-list-strategy: cdi\n"
        "metrics_port: 9100\n"
        "resource-name: example.com/gpu\n"
        "annotation-prefix: file.example.com\n"
        "publish: auto\n"
        "ignored-xids: [13, 43]\n"
        "health-recovery: never\n"
    )
    return path


def test_defaults() -> None:
    cfg = _resolved([])
    assert cfg["device_plugin_dir"] == "/var/lib/kubelet/device-plugins"
    assert cfg["resource_name"] == "nvidia.com/gpu"
    assert cfg["device_list_strategy"] == "envvar"
    assert cfg["device_id_strategy"] == "uuid"
    assert cfg["pod_resources_socket"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert cfg["pod_resources_poll_interval"] == 10.0
    assert cfg["metrics_port"] == 8080
    assert cfg["annotation_prefix"] == "gpu-topology.io"
    assert cfg["publish"] == "auto"
    assert cfg["topology"] is None


def test_precedence_flag_env_file_default(config_file: Path) -> None:
    env = {"GPUPLUGIN_METRICS_PORT": "9200", "GPUPLUGIN_ANNOTATION_PREFIX": "env.example.com"}
    cfg = _resolved(["--config", str(config_file), "--annotation-prefix", "flag.example.com"], env)
    assert cfg["annotation_prefix"] == "flag.example.com"  # flag beats env and file
    assert cfg["metrics_port"] == 9200  # env beats file
    assert cfg["device_list_strategy"] == "cdi"  # file beats default
    assert cfg["resource_name"] == "example.com/gpu"
    assert cfg["device_id_strategy"] == "uuid"  # default
    assert cfg["publish"] == "auto"
    assert cfg["ignored_xids"] == [13, 43]
    assert cfg["health_recovery"] == "never"


def test_config_file_from_env_and_node_name_fallback(config_file: Path) -> None:
    cfg = _resolved([], {"GPUPLUGIN_CONFIG": str(config_file), "NODE_NAME": "gpu-node-1"})
    assert cfg["device_list_strategy"] == "cdi"
    assert cfg["node_name"] == "gpu-node-1"
    cfg = _resolved([], {"NODE_NAME": "gpu-node-1", "GPUPLUGIN_NODE_NAME": "gpu-node-2"})
    assert cfg["node_name"] == "gpu-node-2"


def test_publish_flag_and_env() -> None:
    assert _resolved(["--no-publish"], {"GPUPLUGIN_PUBLISH": "true"})["publish"] is False
    assert _resolved([], {"GPUPLUGIN_PUBLISH": "true"})["publish"] is True
    assert _resolved([], {"GPUPLUGIN_PUBLISH": "auto"})["publish"] == "auto"


def test_topology_flag() -> None:
    assert _resolved(["--topology", str(DGX1)])["topology"] == str(DGX1)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--device-list-strategy", "magic"], {}, "invalid device_list_strategy from --device-list-strategy"),
        (
            [],
            {"GPUPLUGIN_DEVICE_ID_STRATEGY": "serial"},
            "invalid device_id_strategy from GPUPLUGIN_DEVICE_ID_STRATEGY",
        ),
        ([], {"GPUPLUGIN_METRICS_PORT": "http"}, "invalid metrics_port from GPUPLUGIN_METRICS_PORT"),
        (["--metrics-port", "70000"], {}, "70000 is not a TCP port"),
        (["--resource-name", "gpu"], {}, "invalid resource_name from --resource-name"),
        (["--resource-name", "kubernetes.io/gpu"], {}, "reserved for native resources"),
        (["--annotation-prefix", "Not_A_Domain"], {}, "invalid annotation_prefix"),
        (["--topology", "/nonexistent/topo.txt"], {}, "invalid topology from --topology"),
        (["--socket-name", "a/b.sock"], {}, "invalid socket_name"),
        (["--device-plugin-dir", "/" + "d" * 120], {}, "unix socket limit"),
        (["--log-level", "loud"], {}, "invalid log_level"),
        (["--health-recovery", "-1"], {}, "invalid health_recovery"),
        (["--ignored-xids", "13,x"], {}, "invalid ignored_xids"),
        (["--pod-resources-poll-interval", "0"], {}, "invalid pod_resources_poll_interval"),
    ],
)
def test_invalid_values_exit_2_naming_the_field(args: list[str], env: dict[str, str], expected: str) -> None:
    assert expected in _error(args, env)


def test_invalid_file_value_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("device-id-strategy: serial\n")
    out = _error(["--config", str(path)])
    assert "invalid device_id_strategy from config file" in out and str(path) in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("metrics-prot: 9100\n", "unknown setting 'metrics-prot'"),
        ("- a\n- b\n", "must hold a mapping"),
        ("a: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert expected in _error(["--config", str(path)])


def test_missing_config_file(tmp_path: Path) -> None:
    assert "cannot read config file" in _error(["--config", str(tmp_path / "absent.yaml")])


def test_a_sharing_config_dir_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    """It used to be served as an empty directory (whole GPUs, one warning): the team believed its GPUs shared."""
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    out = _error(["--sharing-config-dir", str(config)])
    assert "invalid sharing_config_dir from --sharing-config-dir" in out and str(config) in out
    assert "is a file, not a directory" in out and "--sharing-config-file" in out
    assert _resolved(["--sharing-config-dir", str(tmp_path)])["sharing_config_dir"] == str(tmp_path)
    # a missing one is refused when the plugin starts (a chart's arguments resolve where nothing is mounted)
    absent = tmp_path / "absent"
    assert _resolved(["--sharing-config-dir", str(absent)])["sharing_config_dir"] == str(absent)
    result = CliRunner().invoke(command, ["--topology", str(DGX1), "--no-publish", "--metrics-port", "0"],
                                env={"GPUPLUGIN_SHARING_CONFIG_DIR": str(absent)}, catch_exceptions=False)
    assert result.exit_code == 1
    assert f"Error: sharing config directory {str(absent)!r} (--sharing-config-dir) does not exist" in result.output


def test_nvidias_single_config_file_from_its_environment_variable_or_the_flag(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    assert _resolved([], {"CONFIG_FILE": str(config)})["sharing_config_file"] == str(config)
    assert _resolved(["--sharing-config-file", str(config)])["sharing_config_file"] == str(config)
    assert _resolved(["--config-file", str(config)])["sharing_config_file"] == str(config)  # NVIDIA's flag
    out = _error([], {"CONFIG_FILE": str(tmp_path / "absent.yaml")})
    assert "invalid sharing_config_file from CONFIG_FILE" in out and "does not exist" in out


def test_a_config_file_and_a_config_dir_together_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    out = _error(["--sharing-config-dir", str(tmp_path)], {"CONFIG_FILE": str(config)})
    assert "--sharing-config-dir and --sharing-config-file both name the sharing config; give one" in out
    assert "sharing_config_file from CONFIG_FILE" in out
    out = _error(["--sharing-config-file", str(config), "--sharing-config-default", "ts"])
    assert "--sharing-config-default picks among the configs of --sharing-config-dir" in out
