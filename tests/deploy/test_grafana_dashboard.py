"""deploy/grafana/gpu-topology.json: a well-formed Grafana dashboard whose every query parses as PromQL and names
only metrics (and labels) that the real processes export.

The metric names are checked against the live /metrics of a real `gpuplugin run` (tests/fakes/gpunode.py: kubelet
simulator, fake API server, PodResources) and a real standalone `gpu-extender serve`, each driven through the calls
that give its labelled series samples, so a renamed metric or label fails here rather than in an empty panel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sim.ports import free_port
from tests.deploy.rendering import DEPLOY, ROOT
from tests.fakes.gpunode import gpu_node
from tests.helpers.paths import short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import http_ok, stop_process, wait_serving
from tests.helpers.scheduler import bind_body, cache_args, pod_json

DASHBOARD = DEPLOY / "grafana" / "gpu-topology.json"
TOPOLOGY = ROOT / "gputopo" / "data" / "dgx1-v100-hybrid-cube-mesh.txt"
RESOURCE = "nvidia.com/gpu"
WAIT = 30.0  # liveness bound on a loaded 2-core machine, never a performance figure
# Labels Prometheus attaches to every scraped series (target labels and the ServiceMonitor's relabelling).
TARGET_LABELS = {"namespace", "pod", "node", "instance", "job", "service", "container", "endpoint"}
# What Grafana substitutes before a query reaches Prometheus; values here only need to be valid PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables substituted as Grafana would."""
    variables = {f"${v['name']}": ".*" for v in dashboard["templating"]["list"]} | GRAFANA_VARIABLES
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in sorted(variables, key=len, reverse=True):
                expr = expr.replace(name, variables[name])
            assert "$" not in expr, f"{panel['title']}: undefined variable in {target['expr']}"
            found.append((panel["title"], expr))
    return found


def _selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names the query matches or groups on) for every vector selector of a query."""
    tree = promql_parser.parse(expr)
    grouping: set[str] = set()
    found: list[tuple[str, set[str]]] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, {m.name for m in node.matchers.matchers}))

    promql_parser.walk(tree, visit)
    return [(name, labels | grouping) for name, labels in found]


# ---------------------------------------------------------------------------------------------------------------
# the dashboard itself


def test_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "node"} <= variables
    for panel in panels:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what the panel shows"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_query_parses_as_promql() -> None:
    queries = _queries(_dashboard())
    assert len(queries) >= 20
    for title, expr in queries:
        assert _selectors(expr), f"{title}: no metric in {expr}"


def test_a_broken_query_is_caught() -> None:
    with pytest.raises(ValueError):
        promql_parser.parse('sum by (verb (rate(gpu_extender_requests_total[1m]))')
    assert _selectors('sum by (verb) (rate(x_total{code="500"}[1m]))') == [("x_total", {"code", "verb"})]


def test_the_chart_scrapes_what_the_dashboard_filters_on() -> None:
    """The dashboard's node filter is the label the chart's ServiceMonitor writes."""
    monitor = (DEPLOY / "helm" / "gpu-topology" / "templates" / "servicemonitor.yaml").read_text()
    assert "targetLabel: node" in monitor
    assert "serviceMonitor.enabled" in (DEPLOY / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# against the live processes


def _exposition(url: str) -> dict[str, set[str] | None]:
    """Series name -> label names of its samples, from a live /metrics; None for a series with no sample yet (a
    family without samples still names its series: counters `_total`, histograms `_bucket`/`_sum`/`_count`)."""
    text = httpx.get(url, timeout=10).text
    series: dict[str, set[str] | None] = {}
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",)}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, ("",)):
            series.setdefault(family.name + suffix, None)
        for sample in family.samples:
            series[sample.name] = (series.get(sample.name) or set()) | set(sample.labels)
    return series


@pytest.fixture(scope="module")
def plugin_metrics() -> Iterator[dict[str, set[str] | None]]:
    """A real `gpuplugin run` after registration, a GetPreferredAllocation and an Allocate from the kubelet."""
    port = free_port()
    with gpu_node("dash-node", TOPOLOGY, args=["--metrics-port", str(port)]) as node:
        try:
            ids = [d.id for d in node.kubelet.wait_for_devices(RESOURCE, 8, timeout=WAIT)]
            chosen = node.kubelet.preferred(RESOURCE, ids, [], 2)
            node.kubelet.allocate(RESOURCE, chosen)
            url = f"http://127.0.0.1:{port}/metrics"
            assert eventually(lambda: "gpuplugin_allocations_total" in httpx.get(url, timeout=5).text, WAIT), (
                "timed out waiting for the plugin's metrics")
            yield _exposition(url)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{node.log_tail()}") from None


@pytest.fixture(scope="module")
def extender_metrics() -> Iterator[dict[str, set[str] | None]]:
    """A real standalone `gpu-extender serve` after kube-scheduler's filter, prioritize and bind calls."""
    with short_dir("dash-ext-") as root:
        (root / "inventory.yaml").write_text(yaml.safe_dump({"nodes": [{"name": "n1", "topology": str(TOPOLOGY)}]}))
        port, metrics_port = free_port(), free_port()
        with open(root / "extender.log", "wb") as out:
            process = subprocess.Popen(
                [str(Path(sys.executable).parent / "gpu-extender"), "serve", "--inventory",
                 str(root / "inventory.yaml"), "--host", "127.0.0.1", "--port", str(port), "--metrics-host",
                 "127.0.0.1", "--metrics-port", str(metrics_port)], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_serving(process, lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), WAIT)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                pod = pod_json("trainer", 4)
                args = cache_args(pod, ["n1"])
                assert client.post("/filter", json=args).json()["NodeNames"] == ["n1"]
                client.post("/prioritize", json=args).raise_for_status()
                client.post("/bind", json=bind_body(pod, "n1")).raise_for_status()
                assert client.post("/filter", content=b"{not json").status_code == 400
                yield _exposition(f"http://127.0.0.1:{metrics_port}/metrics")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{(root / 'extender.log').read_text(errors='replace')[-4000:]}") from None
        finally:
            stop_process(process)


def test_every_metric_the_dashboard_queries_is_exported(plugin_metrics: dict[str, set[str] | None],
                                                        extender_metrics: dict[str, set[str] | None]) -> None:
    live = {**plugin_metrics, **extender_metrics}
    missing = sorted({f"{name} (panel {title!r})" for title, expr in _queries(_dashboard())
                      for name, _ in _selectors(expr) if name not in live})
    assert not missing, "the dashboard queries metrics neither process exports:\n" + "\n".join(missing)


def test_every_label_the_dashboard_uses_is_exported(plugin_metrics: dict[str, set[str] | None],
                                                    extender_metrics: dict[str, set[str] | None]) -> None:
    """Labels matched or grouped on are the series' own (where the live process has samples for it) or the ones
    Prometheus adds when scraping."""
    live = {**plugin_metrics, **extender_metrics}
    wrong = []
    for title, expr in _queries(_dashboard()):
        for name, labels in _selectors(expr):
            own = live.get(name)
            if own is not None and not labels <= own | TARGET_LABELS | {"le"}:
                wrong.append(f"{title}: {name} has no label {sorted(labels - own - TARGET_LABELS - {'le'})}")
    assert not wrong, "\n".join(wrong)


def test_the_live_check_sees_samples_for_most_queried_series(plugin_metrics: dict[str, set[str] | None],
                                                     extender_metrics: dict[str, set[str] | None]) -> None:
    """The label check above is not vacuous: the driven calls give most queried series samples to check."""
    live = {**plugin_metrics, **extender_metrics}
    names = {name for _, expr in _queries(_dashboard()) for name, _ in _selectors(expr)}
    sampled = {n for n in names if live.get(n) is not None}
    assert len(sampled) >= 3 * len(names) // 4, f"no samples for {sorted(names - sampled)}"
