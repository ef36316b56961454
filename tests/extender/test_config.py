"""`gpu-extender serve` settings: flag > environment GPU_EXTENDER_<FLAG> > YAML file > default; an invalid value exits
2 naming the setting and where it came from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from extender.cli import serve

# Whatever the machine running the tests has set must not leak into them.
CLEAN = {name: None for name in os.environ if name.startswith("GPU_EXTENDER_")}


def _invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(serve, args, env={**CLEAN, **(env or {})}, catch_exceptions=False)
    return result.exit_code, result.output


def _resolved(args: list[str], env: dict[str, str] | None = None) -> dict:
    code, output = _invoke([*args, "--print-config"], env)
    assert code == 0, output
    return json.loads(output)


def _error(args: list[str], env: dict[str, str] | None = None) -> str:
    code, output = _invoke(args, env)
    assert code == 2, output
    return output


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "extender.yaml"
    path.write_text(
        "reservation-timeout: 120\n"
        "island_penalty: 0.5\n"
        "resource-name: example.com/gpu\n"
        "annotation-prefix: file.example.com\n"
        "log-level: debug\n"
        "allow-insecure-remote: true\n"
    )
    return path


def test_defaults() -> None:
    cfg = _resolved([])
    assert cfg["host"] == "127.0.0.1" and cfg["port"] == 8888
    assert cfg["resource_name"] == "nvidia.com/gpu" and cfg["annotation_prefix"] == "gpu-topology.io"
    assert cfg["reservation_timeout"] == 60.0
    assert cfg["max_body_bytes"] == 10 * 1024 * 1024
    assert cfg["island_penalty"] == 1.0 and cfg["island_spare"] == 4
    assert cfg["allow_insecure_remote"] is False
    assert cfg["metrics_port"] == 0 and cfg["metrics_host"] == "0.0.0.0"
    assert cfg["log_level"] == "info"
    assert cfg["inventory"] is None and cfg["kubeconfig"] is None and cfg["tls_cert"] is None


def test_precedence_flag_env_file_default(config_file: Path) -> None:
    env = {"GPU_EXTENDER_ISLAND_PENALTY": "0.25", "GPU_EXTENDER_ANNOTATION_PREFIX": "env.example.com",
           "GPU_EXTENDER_LOG_LEVEL": "WARNING"}
    cfg = _resolved(["--config", str(config_file), "--annotation-prefix", "flag.example.com"], env)
    assert cfg["annotation_prefix"] == "flag.example.com"  # flag beats env and file
    assert cfg["island_penalty"] == 0.25  # env beats file
    assert cfg["log_level"] == "warning"
    assert cfg["reservation_timeout"] == 120.0  # file beats default
    assert cfg["resource_name"] == "example.com/gpu"
    assert cfg["allow_insecure_remote"] is True
    assert cfg["island_spare"] == 4  # default


def test_config_file_from_env_and_bool_flags(config_file: Path) -> None:
    cfg = _resolved([], {"GPU_EXTENDER_CONFIG": str(config_file)})
    assert cfg["reservation_timeout"] == 120.0 and cfg["allow_insecure_remote"] is True
    assert _resolved(["--no-allow-insecure-remote"], {"GPU_EXTENDER_CONFIG": str(config_file)})[
        "allow_insecure_remote"] is False
    assert _resolved([], {"GPU_EXTENDER_ALLOW_INSECURE_REMOTE": "1"})["allow_insecure_remote"] is True


def test_the_old_serve_scoped_names_are_not_read() -> None:
    assert _resolved([], {"GPU_EXTENDER_SERVE_PORT": "9999", "GPU_EXTENDER_PORT": "9998"})["port"] == 9998


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--port", "70000"], {}, "invalid port from --port: 70000 is not a TCP port"),
        ([], {"GPU_EXTENDER_PORT": "tcp://10.96.0.12:8443"}, "invalid port from GPU_EXTENDER_PORT"),
        ([], {"GPU_EXTENDER_RESERVATION_TIMEOUT": "0"},
         "invalid reservation_timeout from GPU_EXTENDER_RESERVATION_TIMEOUT: reservation timeout must be positive"),
        (["--max-body-bytes", "0"], {}, "invalid max_body_bytes from --max-body-bytes"),
        (["--island-penalty", "-1"], {}, "invalid island_penalty from --island-penalty"),
        (["--island-spare", "x"], {}, "invalid island_spare from --island-spare"),
        (["--annotation-prefix", "Not_A_Domain"], {}, "invalid annotation_prefix from --annotation-prefix"),
        (["--log-level", "loud"], {}, "invalid log_level from --log-level"),
        ([], {"GPU_EXTENDER_ALLOW_INSECURE_REMOTE": "perhaps"},
         "invalid allow_insecure_remote from GPU_EXTENDER_ALLOW_INSECURE_REMOTE"),
        (["--port", "9000", "--metrics-port", "9000"], {}, "--metrics-port 9000 is the API port"),
    ],
)
def test_invalid_values_exit_2_naming_the_setting_and_its_source(args: list[str], env: dict[str, str],
                                                                 expected: str) -> None:
    assert expected in _error(args, env)


def test_invalid_file_value_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("island-spare: -1\n")
    out = _error(["--config", str(path)])
    assert f"invalid island_spare from config file {path}" in out


def test_a_rule_across_settings_names_where_each_came_from(tmp_path: Path) -> None:
    cert = tmp_path / "tls.crt"
    cert.write_text("not checked here\n")
    out = _error([], {"GPU_EXTENDER_TLS_CERT": str(cert)})
    assert "--tls-cert and --tls-key go together (tls_cert from GPU_EXTENDER_TLS_CERT)" in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reservation-timout: 10\n", "unknown setting 'reservation-timout'"),
        ("reservation_timeout_s: 10\n", "unknown setting 'reservation_timeout_s'"),
        ("- a\n", "must hold a mapping"),
        ("port: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = _error(["--config", str(path)])
    assert expected in out and str(path) in out
