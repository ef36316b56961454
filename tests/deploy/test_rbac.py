"""RBAC grants each ServiceAccount exactly the API calls declared in deploy/rbac-calls.yaml: all, and no more.

Which component's code runs under which account follows from the account's app.kubernetes.io/component label:
the scheduler pod runs kube-scheduler and the extender sidecar, so its account carries both components' calls,
plus the built-in roles the upstream second-scheduler setup binds (those are Kubernetes', not ours to trim).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extender.membership.owners import OWNER_KINDS
from extender.membership.ownership import OWNER_RESOURCES
from tests.deploy.rendering import (
    CHART_VARIANTS,
    DEPLOY,
    MANIFESTS,
    Obj,
    all_renderings,
    find,
    render_chart_files,
    rendering_names,
)

CALLS_FILE = DEPLOY / "rbac-calls.yaml"
ACCOUNT_COMPONENTS = {
    "device-plugin": ("plugin",),
    "plugin-cleanup": ("plugin-cleanup",),  # the chart's pre-delete hook Job (gpuplugin cleanup)
    "dra-driver": ("dra",),
    "extender": ("extender", "extender-leader-election"),
    "scheduler": ("kube-scheduler", "extender"),
    "webhook": (),  # answers admission reviews only: no API access at all
    "mps-control": (),  # keeps MPS daemons from a file on the host: no API access at all
}
BUILTIN_ROLES = {
    "scheduler": {
        ("ClusterRole", "system:kube-scheduler", None),
        ("ClusterRole", "system:volume-scheduler", None),
        ("Role", "extension-apiserver-authentication-reader", "kube-system"),
    },
}
Grant = tuple[str, str, str]  # (api group, resource[/subresource], verb)


def declared_calls() -> dict[str, set[Grant]]:
    table = yaml.safe_load(CALLS_FILE.read_text())
    out: dict[str, set[Grant]] = {}
    for component, calls in table.items():
        grants = set()
        for call in calls:
            assert set(call) <= {"verb", "resource", "subresource", "group", "why"}, call
            resource = call["resource"] + (f"/{call['subresource']}" if call.get("subresource") else "")
            grants.add((call.get("group", ""), resource, call["verb"]))
        out[component] = grants
    return out


def rule_grants(rule: dict[str, Any], where: str) -> set[Grant]:
    assert "nonResourceURLs" not in rule, f"{where}: nonResourceURLs"
    for key in ("apiGroups", "resources", "verbs"):
        assert "*" not in rule[key], f"{where}: wildcard in {key}"
    return {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def account_view(objects: list[Obj], account: Obj) -> tuple[set[Grant], set[tuple[str, str, str | None]]]:
    """(grants from roles defined in `objects`, built-in roles bound by reference) of one ServiceAccount."""
    name, namespace = account["metadata"]["name"], account["metadata"]["namespace"]
    grants: set[Grant] = set()
    builtins: set[tuple[str, str, str | None]] = set()
    for binding in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding"):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == name and s.get("namespace") == namespace
                   for s in binding.get("subjects", [])):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        roles = [r for r in find(objects, ref["kind"], ref["name"])
                 if ref["kind"] == "ClusterRole" or r["metadata"]["namespace"] == scope]
        if not roles:
            builtins.add((ref["kind"], ref["name"], scope))
        for role in roles:
            for rule in role["rules"]:
                grants |= rule_grants(rule, f"{ref['kind']}/{ref['name']}")
    return grants, builtins


def job_owner_kinds(objects: list[Obj]) -> set[str]:
    """The owner kinds the extender of a rendering watches: its --job-owner-kinds, all kinds when it has none."""
    for workload in find(objects, "Deployment"):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            for arg in c.get("args") or []:
                if str(arg).startswith("--job-owner-kinds="):
                    return {k for k in str(arg).partition("=")[2].split(",") if k}
    return set(OWNER_KINDS)


def unwatched_owner_calls(objects: list[Obj]) -> set[Grant]:
    """The table's owner-kind calls the rendering's extender does not make (kinds left out of jobOwnerKinds)."""
    kinds = job_owner_kinds(objects)
    return {(r.group, r.plural, verb) for r in OWNER_RESOURCES if r.kind not in kinds for verb in ("list", "watch")}


def extender_leader_election_on(objects: list[Obj]) -> bool:
    """Whether the standalone extender of a rendering runs `gpu-extender serve --leader-elect`."""
    return any("--leader-elect" in (c.get("args") or []) for w in find(objects, "Deployment")
               for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "extender")


def leader_election_on(objects: list[Obj]) -> bool:
    for configmap in find(objects, "ConfigMap"):
        text = configmap.get("data", {}).get("scheduler-config.yaml")
        if text:
            return bool(yaml.safe_load(text).get("leaderElection", {}).get("leaderElect"))
    return False


@pytest.mark.parametrize("rendering", rendering_names())
def test_each_account_gets_exactly_its_components_calls(rendering: str) -> None:
    objects = all_renderings()[rendering]
    calls = declared_calls()
    accounts = find(objects, "ServiceAccount")
    assert accounts
    for account in accounts:
        label = account["metadata"]["labels"]["app.kubernetes.io/component"]
        wanted: set[Grant] = set().union(*(calls[c] for c in ACCOUNT_COMPONENTS[label]))
        if label == "scheduler" and not leader_election_on(objects):
            wanted -= calls["kube-scheduler"]
        if label == "extender" and not extender_leader_election_on(objects):
            wanted -= calls["extender-leader-election"]
        if "extender" in ACCOUNT_COMPONENTS[label]:
            wanted -= unwatched_owner_calls(objects)
        grants, builtins = account_view(objects, account)
        where = f"{rendering}: ServiceAccount {account['metadata']['name']}"
        assert grants - wanted == set(), f"{where} is granted more than its code calls"
        assert wanted - grants == set(), f"{where} lacks grants its code needs"
        assert builtins == BUILTIN_ROLES.get(label, set()), f"{where}: bound built-in roles {builtins}"


@pytest.mark.parametrize("rendering", rendering_names())
def test_workloads_run_under_their_components_account(rendering: str) -> None:
    objects = all_renderings()[rendering]
    accounts = {a["metadata"]["name"]: a for a in find(objects, "ServiceAccount")}
    used = set()
    for workload in find(objects, "DaemonSet") + find(objects, "Deployment") + find(objects, "Job"):
        account = accounts[workload["spec"]["template"]["spec"]["serviceAccountName"]]
        used.add(account["metadata"]["name"])
        assert account["metadata"]["namespace"] == workload["metadata"]["namespace"]
        assert (account["metadata"]["labels"]["app.kubernetes.io/component"]
                == workload["metadata"]["labels"]["app.kubernetes.io/component"])
    assert used == set(accounts), f"{rendering}: unused ServiceAccounts {set(accounts) - used}"


@pytest.mark.parametrize("rendering", rendering_names())
def test_every_defined_role_is_bound(rendering: str) -> None:
    objects = all_renderings()[rendering]
    refs = {(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in find(objects, "RoleBinding")
            + find(objects, "ClusterRoleBinding")}
    for role in find(objects, "Role") + find(objects, "ClusterRole"):
        assert (role["kind"], role["metadata"]["name"]) in refs, f"{rendering}: unbound {role['metadata']['name']}"


def test_checker_notices_an_extra_verb_and_a_missing_one() -> None:
    objects = [dict(o) for o in all_renderings()["kustomize:deploy/manifests"]]
    account = find(objects, "ServiceAccount", "gpu-topology-plugin")[0]
    role = find(objects, "ClusterRole", "gpu-topology-plugin")[0]
    role["rules"] = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch", "update"]}]
    grants, _ = account_view(objects, account)
    wanted = declared_calls()["plugin"]
    assert ("", "nodes", "update") in grants - wanted
    assert ("", "pods", "watch") in wanted - grants


def _rules_without_comment(text: str, source: str) -> list[str]:
    """Rules of Roles/ClusterRoles in `text` not directly preceded by a comment line saying what they are for."""
    lines = text.splitlines()
    missing = []
    for document in yaml.compose_all(text):
        if document is None or not isinstance(document, yaml.MappingNode):
            continue
        fields = {k.value: v for k, v in document.value}
        if fields.get("kind") is None or fields["kind"].value not in ("Role", "ClusterRole"):
            continue
        for rule in getattr(fields.get("rules"), "value", []):
            previous = lines[rule.start_mark.line - 1].strip()
            if not previous.startswith("#"):
                missing.append(f"{source}:{rule.start_mark.line + 1}")
    return missing


def test_every_rule_says_what_it_is_for() -> None:
    missing: list[str] = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        missing += _rules_without_comment(path.read_text(), str(path.relative_to(DEPLOY)))
    for name, variant in CHART_VARIANTS.items():
        for template, text in render_chart_files(variant).items():
            if template.endswith(".yaml"):
                missing += _rules_without_comment(text, f"helm:{name}:{template}")
    assert missing == []


def test_calls_table_is_documented_and_known_components_only() -> None:
    text = Path(CALLS_FILE).read_text()
    assert text.startswith("#") and "Format:" in text
    assert set(declared_calls()) == {c for comps in ACCOUNT_COMPONENTS.values() for c in comps}
