"""docs/generated/ is what scripts/gen_reference.py makes from the code and the chart today, and covers all of it:
every chart value with a description, every subcommand and option, every metric, every annotation and label key.

A reference list kept by hand drifts (docs/configuration.md once claimed every chart value and named 63 of 170); one
regenerated and compared here cannot."""

from __future__ import annotations

import shutil
from importlib.metadata import entry_points
from pathlib import Path

import click
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from scripts import gen_reference
from tests.deploy.rendering import CHART, ROOT

REGENERATE = f"run `{gen_reference.COMMAND}` from the repository root"


@pytest.mark.parametrize("name", sorted(gen_reference.GENERATORS))
def test_generated_file_is_current(name: str) -> None:
    path = ROOT / gen_reference.OUT / name
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: {REGENERATE}"
    assert path.read_text() == gen_reference.GENERATORS[name](), (
        f"{path.relative_to(ROOT)} differs from what the code defines: {REGENERATE}")


def test_check_mode_names_stale_files_and_writing_makes_them_current(tmp_path: Path, capsys) -> None:
    assert gen_reference.main(["--check", "--root", str(tmp_path)]) == 1
    assert "chart-values.md" in capsys.readouterr().err
    assert not (tmp_path / gen_reference.OUT).exists()
    assert gen_reference.main(["--root", str(tmp_path)]) == 0
    assert gen_reference.main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / gen_reference.OUT / "metrics.md").write_text("edited by hand\n")
    assert gen_reference.main(["--check", "--root", str(tmp_path)]) == 1
    assert "metrics.md" in capsys.readouterr().err


# --- chart values ---------------------------------------------------------------------------------------------------


def _leaf_paths(data: object, path: tuple[str, ...] = ()) -> list[str]:
    if isinstance(data, dict) and data:
        return [p for key, value in data.items() for p in _leaf_paths(value, (*path, key))]
    return [".".join(path)]


def test_every_chart_value_is_listed_with_a_description() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = {v.path: v for v in gen_reference.chart_values()}
    leaves = _leaf_paths(values)
    assert len(leaves) > 150
    assert set(leaves) <= set(rows)
    undocumented = [path for path, row in rows.items() if not row.description]
    assert undocumented == [], (f"values without a `# -- description` comment directly above their key in "
                                f"values.yaml: {undocumented}")


def test_a_top_level_value_only_the_schema_has_is_listed() -> None:
    """`enabled` is read by a parent chart's condition: and has no default in values.yaml."""
    (enabled,) = [v for v in gen_reference.chart_values() if v.path == "enabled"]
    assert enabled.type == "boolean" and "condition" in enabled.description and enabled.default == ""


def test_a_value_whose_description_is_removed_is_reported(tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    text = (chart / "values.yaml").read_text()
    marked = "  # -- Seconds a plan is reserved on its node"
    assert marked in text
    (chart / "values.yaml").write_text(text.replace(marked, "  # Seconds a plan is reserved on its node"))
    rows = {v.path: v for v in gen_reference.chart_values(chart)}
    assert rows["extender.reservationTimeout"].description == ""
    assert rows["extender.islandSpare"].description


def test_descriptions_follow_the_helm_docs_convention() -> None:
    text = ("# A note about the whole file.\n"
            "a:\n"
            "  # A note on b and c, not part of either description.\n"
            "  # -- What b does,\n"
            "  #   continued.\n"
            "  b: 1\n"
            "  c: [x]\n"
            "\n"
            "  # -- Separated from d by a blank line.\n"
            "\n"
            "  # -- What d does, with a flag wrapped onto its own line:\n"
            "  # --like-this stays part of it.\n"
            "  d:\n"
            "    - # -- inside a list item: not a key\n"
            "      e: 2\n")
    assert gen_reference.value_descriptions(text) == {
        ("a", "b"): "What b does, continued.",
        ("a", "d"): "What d does, with a flag wrapped onto its own line: --like-this stays part of it."}


def test_chart_value_types_come_from_the_schema() -> None:
    rows = {v.path: v for v in gen_reference.chart_values()}
    assert rows["image.pullPolicy"].type == 'one of "Always", "IfNotPresent", "Never"'  # through a $ref
    assert rows["plugin.optIn"].type == "boolean"
    assert rows["plugin.optIn"].default == "true"
    assert rows["scheduler.resources.limits.cpu"].default == '"1"'


# --- flags ----------------------------------------------------------------------------------------------------------


def _groups() -> list[tuple[str, click.Group, set[str]]]:
    from extender.cli import main as extender_main
    from gpuplugin.cli import ENTRY_POINT_GROUP
    from gpuplugin.cli import main as plugin_main

    plugged = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert isinstance(plugin_main, click.Group) and isinstance(extender_main, click.Group)
    return [("gpuplugin", plugin_main, plugged), ("gpu-extender", extender_main, set())]


def _sections(text: str) -> dict[str, str]:
    parts = text.split("\n## ")[1:]
    return {part.split("\n", 1)[0].strip("`"): part for part in parts}


def test_flags_cover_every_subcommand_and_option() -> None:
    sections = _sections(gen_reference.render_flags())
    expected = []
    for prog, group, plugged in _groups():
        parent = click.Context(group, info_name=prog)
        for name in group.list_commands(parent):
            command = group.get_command(parent, name)
            if command is None or name in plugged:
                continue
            expected.append(f"{prog} {name}")
            section = sections.get(f"{prog} {name}", "")
            options = [opt for p in command.params if isinstance(p, click.Option) for opt in p.opts]
            missing = [opt for opt in options if f"`{opt}" not in section and f", {opt}" not in section]
            assert missing == [], f"{prog} {name}: options not in flags.md: {missing}"
    assert sorted(sections) == sorted(expected)
    assert {"gpuplugin run", "gpuplugin dra", "gpu-extender serve", "gpu-extender webhook"} <= set(sections)
    assert "gpuplugin demo" not in sections  # the simulator's, plugged in, not the product's


def test_settings_show_their_default_and_environment_variable() -> None:
    serve = _sections(gen_reference.render_flags())["gpu-extender serve"]
    (row,) = [line for line in serve.splitlines() if line.startswith("| `--reservation-timeout")]
    assert "`60.0`" in row or "`60`" in row
    assert "`GPU_EXTENDER_RESERVATION_TIMEOUT`" in row


# --- metrics and keys -----------------------------------------------------------------------------------------------


def _exposed_families(build) -> set[str]:
    """The families `/metrics` shows (a counter's without `_total`), read through the public collect()."""
    registry = CollectorRegistry()
    build(registry)
    assert generate_latest(registry)  # renders as /metrics does
    return {family.name for family in registry.collect()}


def test_metrics_list_every_family_each_process_exposes() -> None:
    from extender.metrics import ExtenderMetrics
    from extender.webhook.metrics import WebhookMetrics
    from gpuplugin.dra.metrics import DraMetrics
    from gpuplugin.metrics import PluginMetrics

    listed = {(d.process, d.name.removesuffix("_total")) for d in gen_reference.metric_docs()}
    for process, build in (("gpuplugin run", PluginMetrics), ("gpuplugin dra", DraMetrics),
                           ("gpu-extender serve", ExtenderMetrics), ("gpu-extender webhook", WebhookMetrics)):
        families = _exposed_families(build)
        assert families, process
        assert {(process, f) for f in families} <= listed, process
    assert ("gpuplugin mps-control", "gpuplugin_mps_daemon_answering") in listed
    labels = {d.name: d.labels for d in gen_reference.metric_docs()}
    assert labels["gpu_extender_kube_watch_events_total"] == ("kind", "type")


def test_contract_lists_every_key_with_the_default_prefix() -> None:
    from gputopo.contract import DEFAULT_KEYS

    keys = {d.key for d in gen_reference.key_docs()}
    for key in (DEFAULT_KEYS.topology, DEFAULT_KEYS.state, DEFAULT_KEYS.plan, DEFAULT_KEYS.placement,
                DEFAULT_KEYS.webhook, DEFAULT_KEYS.device_plugin_label, DEFAULT_KEYS.extender_role,
                *DEFAULT_KEYS.published_annotations):
        assert key in keys
    assert "gpu-topology.io/allreduce-gbps-<size>" in keys


def test_every_key_says_what_it_is_for() -> None:
    """A key without a docstring in gputopo.contract.Keys would be listed with an empty meaning."""
    missing = [d.key for d in gen_reference.key_docs() if not d.description.strip()]
    assert not missing, f"keys without a meaning (give their Keys member a docstring): {missing}"


def test_node_conditions_and_events_come_from_the_plugins_constants() -> None:
    from gpuplugin import publisher

    text = gen_reference.render_contract()
    for name in (publisher.CONFIG_CONDITION, publisher.CONFIG_REFUSED, publisher.CONFIG_ACCEPTED):
        assert f"`{name}`" in text
