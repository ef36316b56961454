"""The admission webhook as deployed: the chart's and kustomize's objects validate against the Kubernetes schemas
of every supported version, follow the container-security and NetworkPolicy rules of the rest of deploy/, get no
API access, and wire together: the configuration fails open fast (failurePolicy Ignore, a short timeout), calls the
Service that selects the webhook pods, trusts the CA that signed their certificate, sees only the namespaces and
pods it should, and its CEL matchConditions let through exactly the pods the webhook would patch."""

from __future__ import annotations

import base64
import copy
import datetime
import functools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import celpy
import helm_python
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from extender.webhook import review
from extender.webhook.command import command
from extender.webhook.config import SETTINGS
from gputopo.contract import DEFAULT_KEYS
from tests.deploy import schemas, security
from tests.deploy.rendering import (
    CHART,
    CHART_VARIANTS,
    DEPLOY,
    ChartVariant,
    Obj,
    containers,
    find,
    kustomize_build,
    render_chart,
    render_chart_files,
)
from tests.extender.webhook.recordings import ADMISSION, SCHEDULER
from tests.extender.webhook.recordings import review as recorded

CERT_MANAGER_KINDS = {"Issuer", "Certificate", "ClusterIssuer"}
WEBHOOK_VARIANTS: dict[str, ChartVariant] = {
    "defaults": ChartVariant("gpu-topology", "gpu-topology", {"webhook": {"enabled": True}}),
    "cert-manager": ChartVariant("gpu-topology", "gpu-topology",
                                 {"webhook": {"enabled": True, "certManager": {"enabled": True}}}),
    "custom": ChartVariant("prod", "gpu-system", {
        **copy.deepcopy(CHART_VARIANTS["custom"].values),
        "webhook": {"enabled": True, "replicas": 3, "port": 9443, "metricsPort": 9081, "timeoutSeconds": 5,
                    "namespaces": "opt-in", "pods": "opt-in", "excludeNamespaces": ["kube-system", "batch"],
                    "wholeJobs": True,
                    "certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer", "name": "acme-ca"}},
                    "priorityClassName": "acme-critical", "podAnnotations": {"acme.example/team": "ml"},
                    "podLabels": {"acme.example/cost-center": "gpu"}, "tolerations": [{"operator": "Exists"}],
                    "podDisruptionBudget": {"minAvailable": 2}}}),
    "minimal": ChartVariant("gpu-topology", "gpu-topology", {
        "webhook": {"enabled": True, "replicas": 1, "podDisruptionBudget": {"enabled": False}},
        "networkPolicy": {"enabled": False}}),
}


def _webhook_objects(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "webhook"]


@functools.cache
def renderings() -> dict[str, list[Obj]]:
    """The webhook's objects of each rendering, made at first use (not at collection)."""
    out = {f"helm:{name}": _webhook_objects(render_chart(v)) for name, v in WEBHOOK_VARIANTS.items()}
    out["kustomize:deploy/webhook"] = kustomize_build(DEPLOY / "webhook")
    assert sorted(out) == RENDERING_NAMES
    return out


RENDERING_NAMES = sorted([*(f"helm:{name}" for name in WEBHOOK_VARIANTS), "kustomize:deploy/webhook"])


def _one(objects: list[Obj], kind: str) -> Obj:
    (found,) = find(objects, kind)
    return found


def _hook(objects: list[Obj]) -> dict[str, Any]:
    (hook,) = _one(objects, "MutatingWebhookConfiguration")["webhooks"]
    return hook


def _container(objects: list[Obj]) -> tuple[dict[str, Any], dict[str, Any]]:
    ((pod, container),) = list(containers(_one(objects, "Deployment")))
    return pod, container


def test_on_by_default_with_the_second_scheduler_and_never_with_the_default_one() -> None:
    """The default install makes GPU pods go to the topology-aware scheduler without changing them; with the
    extender wired into the default scheduler every pod already goes through it, so no webhook is rendered."""
    kinds = {o["kind"] for o in _webhook_objects(render_chart(CHART_VARIANTS["defaults"]))}
    assert {"MutatingWebhookConfiguration", "Deployment", "Service", "Secret"} <= kinds
    default_mode = ChartVariant("r", "ns", {"webhook": {"enabled": True}, "scheduler": {"mode": "default-scheduler"}})
    assert _webhook_objects(render_chart(default_mode)) == []
    assert _webhook_objects(render_chart(ChartVariant("r", "ns", {"webhook": {"enabled": False}}))) == []


@pytest.mark.parametrize("version", schemas.supported_versions())
def test_every_object_validates_strictly(version: str) -> None:
    problems = []
    for name, objects in renderings().items():
        api = [o for o in objects if o["kind"] not in CERT_MANAGER_KINDS]
        problems += [f"[{name}] {p}" for p in schemas.failures(api, version)]
    assert problems == []


@pytest.mark.parametrize("name", sorted(WEBHOOK_VARIANTS))
def test_helm_lint_is_clean(name: str) -> None:
    versions = schemas.supported_versions()
    for version in (versions[0], versions[-1]):
        variant = WEBHOOK_VARIANTS[name]
        report = helm_python.lint(CHART, variant.values, strict=True, namespace=variant.namespace,
                                  kube_version=f"v{version}")
        assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", RENDERING_NAMES)
def test_security_rules_network_policy_and_no_api_access(name: str) -> None:
    objects = renderings()[name]
    assert security.findings(objects) == []
    pod, _ = _container(objects)
    account = _one(objects, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
    policies = find(objects, "NetworkPolicy")
    if name == "helm:minimal":
        assert policies == []
        return
    (policy,) = policies
    labels = _one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {"https", "http-metrics"}


@pytest.mark.parametrize("name", RENDERING_NAMES)
def test_the_api_server_fails_open_fast_and_reaches_the_pods(name: str) -> None:
    objects = renderings()[name]
    hook = _hook(objects)
    assert hook["failurePolicy"] == "Ignore" and 1 <= hook["timeoutSeconds"] <= 5
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    recorded_hook = json.loads((ADMISSION / "mutatingwebhookconfiguration-failurepolicy-ignore.json").read_text()
                               )["webhooks"][0]
    assert hook["rules"] == recorded_hook["rules"] and hook["reinvocationPolicy"] == "Never"
    ref = hook["clientConfig"]["service"]
    service = _one(objects, "Service")
    assert (ref["name"], ref["namespace"], ref["path"]) == (service["metadata"]["name"],
                                                           service["metadata"]["namespace"], "/mutate")
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
    pod, container = _container(objects)
    labels = _one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    https = {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]]
    settings = SETTINGS.load(_flags(container["args"]), env={})
    assert settings.port == https
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[_cert_dir(container["args"])])
    assert volume["secret"]["secretName"] == _secret_name(objects)


def _flags(args: list[str]) -> dict[str, Any]:
    """The webhook's flags as its command parses them (files are checked when loaded, not here)."""
    assert args[0] == "webhook"
    flags = dict(command.make_context("webhook", args[1:]).params)
    flags.pop("config_file"), flags.pop("print_config")
    for key in ("tls_cert", "tls_key"):
        flags[key] = None if flags[key] is None else __file__  # a readable file stands in for the mounted one
    return flags


def _cert_dir(args: list[str]) -> str:
    (path,) = [a.split("=", 1)[1] for a in args if a.startswith("--tls-cert=")]
    return path.rsplit("/", 1)[0]


def _secret_name(objects: list[Obj]) -> str:
    certificates = [c for c in find(objects, "Certificate") if not c["spec"].get("isCA")]
    if certificates:
        (certificate,) = certificates
        return certificate["spec"]["secretName"]
    return _one(objects, "Secret")["metadata"]["name"]


@pytest.mark.parametrize("name", RENDERING_NAMES)
def test_the_webhook_sets_the_schedulers_name_for_the_managed_resource(name: str) -> None:
    objects = renderings()[name]
    _, container = _container(objects)
    settings = SETTINGS.load(_flags(container["args"]), env={})
    values = WEBHOOK_VARIANTS[name.split(":")[1]].values if name.startswith("helm:") else {}
    assert settings.scheduler_name == values.get("scheduler", {}).get("schedulerName", SCHEDULER)
    assert settings.resource_name == values.get("resourceName", "nvidia.com/gpu")
    assert settings.annotation_prefix == values.get("annotationPrefix", "gpu-topology.io")
    assert f"'{settings.resource_name}'" in _hook(objects)["matchConditions"][0]["expression"]


def test_the_charts_own_certificate_is_what_the_ca_bundle_trusts() -> None:
    objects = renderings()["helm:defaults"]
    secret, hook = _one(objects, "Secret"), _hook(objects)
    assert secret["type"] == "kubernetes.io/tls"
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    service = _one(objects, "Service")["metadata"]
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    assert f"{service['name']}.{service['namespace']}.svc" in names  # the name the API server dials
    assert ExtendedKeyUsageOID.SERVER_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=3000)


@pytest.mark.parametrize("name", ["helm:cert-manager", "helm:custom", "kustomize:deploy/webhook"])
def test_cert_manager_issues_the_certificate_and_fills_the_ca_bundle(name: str) -> None:
    objects = renderings()[name]
    configuration = _one(objects, "MutatingWebhookConfiguration")
    assert "caBundle" not in _hook(objects)["clientConfig"] and find(objects, "Secret") == []
    (certificate,) = [c for c in find(objects, "Certificate") if not c["spec"].get("isCA")]
    meta = certificate["metadata"]
    assert configuration["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from":
                                                        f"{meta['namespace']}/{meta['name']}"}
    service = _one(objects, "Service")["metadata"]
    assert f"{service['name']}.{service['namespace']}.svc" in certificate["spec"]["dnsNames"]
    issuer = certificate["spec"]["issuerRef"]
    if name == "helm:custom":
        assert issuer == {"kind": "ClusterIssuer", "name": "acme-ca"} and find(objects, "Issuer") == []
        return
    (ca_issuer,) = [i for i in find(objects, "Issuer") if i["metadata"]["name"] == issuer["name"]]
    (ca,) = [c for c in find(objects, "Certificate") if c["spec"].get("isCA")]
    assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]


def test_kustomize_installs_the_same_webhook_as_the_chart_with_cert_manager() -> None:
    """The same objects and pod as the chart's defaults; its matchConditions are the chart's with wholeJobs (a static
    file cannot follow the switch: a Kubeflow job's pods reach it, and it leaves those asking no GPU alone unless
    --whole-jobs is added to its args)."""
    chart, kustomize = renderings()["helm:cert-manager"], renderings()["kustomize:deploy/webhook"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in chart) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in kustomize)
    whole_jobs = ChartVariant("gpu-topology", "gpu-topology",
                              {"webhook": {"enabled": True, "wholeJobs": True, "certManager": {"enabled": True}}})
    assert _hook(_webhook_objects(render_chart(whole_jobs))) == _hook(kustomize)
    assert {k: v for k, v in _hook(chart).items() if k != "matchConditions"} == {
        k: v for k, v in _hook(kustomize).items() if k != "matchConditions"}

    def pod(objects: list[Obj]) -> dict[str, Any]:
        spec = copy.deepcopy(_one(objects, "Deployment")["spec"]["template"]["spec"])
        spec.pop("affinity")  # selector labels differ (the chart adds the release)
        return spec

    assert pod(chart) == pod(kustomize)


# -- who the webhook sees ------------------------------------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's meaning (matchLabels, In, NotIn, Exists, DoesNotExist)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _namespace(name: str, **labels: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name, **labels}


def test_opt_out_sees_every_namespace_and_pod_but_the_excluded() -> None:
    hook = _hook(renderings()["helm:defaults"])
    ns, pods = hook["namespaceSelector"], hook["objectSelector"]
    assert _selects(ns, _namespace("ml")) and _selects(pods, {"app": "train"})
    assert not _selects(ns, _namespace("kube-system")) and not _selects(ns, _namespace("gpu-topology"))
    assert not _selects(ns, _namespace("ml", **{"gpu-topology.io/webhook": "disabled"}))
    assert not _selects(pods, {"gpu-topology.io/webhook": "disabled"})


def test_opt_in_sees_only_labelled_namespaces_and_pods() -> None:
    hook = _hook(renderings()["helm:custom"])
    label = "topo.acme.example/webhook"
    ns, pods = hook["namespaceSelector"], hook["objectSelector"]
    assert not _selects(ns, _namespace("ml")) and _selects(ns, _namespace("ml", **{label: "enabled"}))
    for never in ("kube-system", "gpu-topology-prod", "batch"):
        assert not _selects(ns, _namespace(never, **{label: "enabled"}))
    assert _selects(pods, {label: "enabled"}) and not _selects(pods, {"app": "train"})


# -- matchConditions: evaluated with a CEL implementation ------------------------------------------------------------


def _conditions(objects: list[Obj]) -> list[Any]:
    env = celpy.Environment()
    return [env.program(env.compile(c["expression"])) for c in _hook(objects)["matchConditions"]]


def _passes(programs: list[Any], pod: dict[str, Any]) -> bool:
    activation = {"object": celpy.json_to_cel(pod)}
    return all(bool(p.evaluate(activation)) for p in programs)


POLICY = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook")
NVLINK = {DEFAULT_KEYS.require_nvlink: "true"}
PS_LABELS = {"training.kubeflow.org/job-name": "tf-0", "training.kubeflow.org/operator-name": "tfjob-controller",
             "training.kubeflow.org/replica-type": "ps", "training.kubeflow.org/replica-index": "0"}


def _pods() -> dict[str, dict[str, Any]]:
    def init_only(r: dict[str, Any], restart: str | None = None) -> None:
        c = r["object"]["spec"]["containers"][0]
        r["object"]["spec"]["initContainers"] = [{"name": "i", "resources": c.pop("resources"),
                                                  **({"restartPolicy": restart} if restart else {})}]

    changes: dict[str, Any] = {
        "recorded": None,
        "requests only": lambda r: r["object"]["spec"]["containers"][0]["resources"].pop("limits"),
        "init container only": init_only,
        "sidecar only": lambda r: init_only(r, "Always"),
        "no scheduler name": lambda r: r["object"]["spec"].pop("schedulerName"),
        "another scheduler": lambda r: r["object"]["spec"].update(schedulerName="volcano"),
        "ours already": lambda r: r["object"]["spec"].update(schedulerName=SCHEDULER),
        "ours already, require-nvlink": lambda r: (r["object"]["spec"].update(schedulerName=SCHEDULER),
                                                   r["object"]["metadata"].update(annotations=dict(NVLINK))),
        "another scheduler, require-nvlink": lambda r: (r["object"]["spec"].update(schedulerName="volcano"),
                                                        r["object"]["metadata"].update(annotations=dict(NVLINK))),
        "no resources": lambda r: r["object"]["spec"]["containers"][0].pop("resources"),
        "another resource": lambda r: r["object"]["spec"]["containers"][0].update(
            resources={"limits": {"amd.com/gpu": "1"}}),
        "zero GPUs": lambda r: r["object"]["spec"]["containers"][0].update(
            resources={"limits": {"nvidia.com/gpu": "0"}}),
        "shared (renameByDefault)": lambda r: r["object"]["spec"]["containers"][0].update(
            resources={"limits": {"nvidia.com/gpu.shared": "1"}, "requests": {"nvidia.com/gpu.shared": "1"}}),
        "MIG instance": lambda r: r["object"]["spec"]["containers"][0].update(
            resources={"limits": {"nvidia.com/mig-1g.10gb": "1"}}),
        "shared MIG instance": lambda r: r["object"]["spec"]["containers"][0].update(
            resources={"requests": {"nvidia.com/mig-1g.10gb.shared": "1"}}),
        "renamed share": lambda r: r["object"]["spec"]["containers"][0].update(
            resources={"limits": {"acme.example/inference": "1"}}),
        "parameter server": lambda r: (r["object"]["metadata"].update(labels=dict(PS_LABELS)),
                                       r["object"]["spec"]["containers"][0].update(
                                           resources={"requests": {"cpu": "2"}})),
    }
    return {k: recorded(v)["request"]["object"] for k, v in changes.items()}


RENAMED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n" \
          "      rename: acme.example/inference\n"
# Pods let through that the webhook answers without a patch: 0 GPUs, and a pod already naming our scheduler with
# no topology annotation (it needs no affinity; the condition cannot read the annotations' meaning).
CALLS = {"zero GPUs", "ours already"}
MATCH_VARIANTS: dict[str, tuple[ChartVariant, review.Policy, set[str]]] = {
    # rendering, the webhook's policy as its args give it, the pods it lets through without patching (a call)
    "defaults": (WEBHOOK_VARIANTS["defaults"], POLICY, CALLS),
    "sharing config with a rename": (
        ChartVariant("gpu-topology", "gpu-topology", {"webhook": {"enabled": True}, "plugin": {"sharing": {
            "enabled": True, "configs": {"ts": RENAMED}}}}),
        review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook", extra_resources=(
            "acme.example/inference",)), CALLS),
    "whole jobs": (ChartVariant("gpu-topology", "gpu-topology", {"webhook": {"enabled": True, "wholeJobs": True}}),
                   review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook", whole_jobs=True),
                   CALLS),
}


@functools.cache
def _variant_conditions(variant: str) -> list[Any]:
    return _conditions(_webhook_objects(render_chart(MATCH_VARIANTS[variant][0])))


@pytest.mark.parametrize("variant", sorted(MATCH_VARIANTS))
@pytest.mark.parametrize("name", sorted(_pods()))
def test_match_conditions_let_through_every_pod_the_webhook_would_patch(variant: str, name: str) -> None:
    """A condition that dropped a pod the webhook patches would lose it silently; letting through a pod it leaves
    alone only costs a call (a pod asking for 0 GPUs). A patch is a schedulerName or, for a pod already naming our
    scheduler, the node affinity of its topology annotations, the only part of them the Cluster Autoscaler sees.
    The webhook's own policy is what the same rendering's args give it (test_the_rendered_args_give_the_policy)."""
    _, policy, extra_calls = MATCH_VARIANTS[variant]
    pod = _pods()[name]
    passes = _passes(_variant_conditions(variant), pod)
    request = recorded(lambda r: r.update(object=pod))["request"]
    patched = bool(review.decide(request, policy).patch)
    assert passes or not patched
    assert passes == (patched or name in extra_calls), name


@pytest.mark.parametrize("variant", sorted(MATCH_VARIANTS))
def test_the_rendered_args_give_the_policy(variant: str) -> None:
    chart, policy, _ = MATCH_VARIANTS[variant]
    _, container = _container(_webhook_objects(render_chart(chart)))
    settings = SETTINGS.load(_flags(container["args"]), env={})
    assert (settings.resource_name, settings.whole_jobs, settings.extra_resources) == (
        policy.resource, policy.whole_jobs, policy.extra_resources)


def test_a_parameter_server_reaches_the_webhook_only_with_whole_jobs() -> None:
    """The platform team's TFJob: its PS pods ask no GPU; the apiserver calls the webhook for them only when the
    chart renders --whole-jobs (and kustomize, which cannot follow the switch, always: its webhook leaves them
    alone unless --whole-jobs is added)."""
    ps = _pods()["parameter server"]
    assert not _passes(_conditions(renderings()["helm:defaults"]), ps)
    assert _passes(_conditions(renderings()["helm:custom"]), ps)  # wholeJobs
    assert _passes(_conditions(renderings()["kustomize:deploy/webhook"]), ps)


def test_a_pod_naming_the_charts_scheduler_reaches_the_webhook_and_one_naming_another_does_not() -> None:
    """The condition names the scheduler the chart installs (`scheduler.schedulerName`), whatever it is called:
    a pod naming it gets its affinity; one naming the default name of another install, or another scheduler, is
    never sent."""
    def naming(scheduler: str, resource: str = "nvidia.com/gpu") -> dict[str, Any]:
        pod = copy.deepcopy(_pods()["ours already, require-nvlink"])
        pod["spec"]["schedulerName"] = scheduler
        pod["spec"]["containers"][0]["resources"] = {"limits": {resource: "2"}}
        return pod

    custom = _conditions(renderings()["helm:custom"])  # scheduler.schedulerName topology-aware, acme.example/gpu
    assert _passes(custom, naming("topology-aware", "acme.example/gpu"))
    assert not _passes(custom, naming(SCHEDULER, "acme.example/gpu"))
    assert not _passes(custom, naming("volcano", "acme.example/gpu"))
    for name in ("helm:defaults", "kustomize:deploy/webhook"):
        conditions = _conditions(renderings()[name])
        assert _passes(conditions, naming(SCHEDULER)) and _passes(conditions, naming("default-scheduler"))
        assert not _passes(conditions, naming("topology-aware")) and not _passes(conditions, naming("volcano"))


# -- bad values ----------------------------------------------------------------------------------------------------

BAD: dict[str, tuple[dict[str, Any], str]] = {
    "long timeout": ({"timeoutSeconds": 31}, "/webhook/timeoutSeconds"),
    "zero timeout": ({"timeoutSeconds": 0}, "/webhook/timeoutSeconds"),
    "unknown namespace mode": ({"namespaces": "some"}, "/webhook/namespaces"),
    "unknown pod mode": ({"pods": "all"}, "/webhook/pods"),
    "typo": ({"timeout": 2}, "timeout"),
    "issuer of another kind": ({"certManager": {"enabled": True, "issuerRef": {"kind": "Vault", "name": "v"}}},
                               "/webhook/certManager/issuerRef/kind"),
    "undrainable": ({"replicas": 1}, "webhook.podDisruptionBudget.minAvailable must be below"),
    "metrics on the HTTPS port": ({"metricsPort": 8443}, "webhook.metricsPort must differ"),
    "selector label in podLabels": ({"podLabels": {"app.kubernetes.io/name": "x"}}, "podLabels may not set"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_fail_with_a_message_naming_them(case: str) -> None:
    values, named = BAD[case]
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart_files(ChartVariant("r", "ns", {"webhook": {"enabled": True, **values}}))
    assert named in str(caught.value)


# -- certificates kept across upgrades (Helm's lookup against an API server) -----------------------------------------


class _Secrets(BaseHTTPRequestHandler):
    """Just enough of an API server for Helm's `lookup "v1" "Secret"`: the core group's discovery, then GET."""

    store: ClassVar[dict[str, Any]] = {}

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/api/v1":
            code, body = 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                 "verbs": ["get"]}]}
        elif path in self.store:
            code, body = 200, self.store[path]
        else:
            code, body = 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                               "code": 404}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _certificates(config: helm_python.Config, *, upgrade: bool) -> tuple[dict[str, str], str]:
    """(the Secret's data, the caBundle) of a cluster-aware render, as `helm install` / `helm upgrade` makes it."""
    files = config.render(helm_python.Chart.load(CHART), {"webhook": {"enabled": True}}, name="gpu-topology",
                          namespace="gpu-topology", is_install=not upgrade, is_upgrade=upgrade)
    objects = [d for path, text in files.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    return _one(objects, "Secret")["data"], _hook(objects)["clientConfig"]["caBundle"]


def test_an_upgrade_keeps_the_certificate_and_a_damaged_secret_is_replaced() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Secrets)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    path = "/api/v1/namespaces/gpu-topology/secrets/gpu-topology-webhook-tls"
    try:
        with helm_python.Config(kube_apiserver=f"http://127.0.0.1:{server.server_address[1]}") as config:
            installed, bundle = _certificates(config, upgrade=False)
            assert bundle == installed["ca.crt"]
            _Secrets.store[path] = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                                    "data": installed, "metadata": {"name": "gpu-topology-webhook-tls",
                                                                    "namespace": "gpu-topology"}}
            upgraded, bundle = _certificates(config, upgrade=True)
            assert upgraded == installed and bundle == installed["ca.crt"], "the pods' files and the caBundle agree"
            _Secrets.store[path]["data"] = {"tls.crt": installed["tls.crt"]}  # key and CA lost
            repaired, bundle = _certificates(config, upgrade=True)
            assert repaired["ca.crt"] != installed["ca.crt"] and bundle == repaired["ca.crt"]
    finally:
        _Secrets.store.clear()
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_whole_jobs_is_a_switch_off_by_default() -> None:
    """webhook.wholeJobs renders --whole-jobs (a Kubeflow job's CPU-only pods to our scheduler), which the
    webhook's settings accept; off, the flag is absent."""
    args = {name: _container(objs)[1]["args"] for name, objs in renderings().items()}
    assert "--whole-jobs" in args["helm:custom"]
    assert all("--whole-jobs" not in a for name, a in args.items() if name != "helm:custom")
    assert SETTINGS.load({"whole_jobs": True, "tls_cert": __file__, "tls_key": __file__}, env={}).whole_jobs
    assert any(o.opts == ["--whole-jobs"] for o in command.params), "a bare --whole-jobs flag (as rendered)"
