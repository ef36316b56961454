"""`gpuplugin node-template`: what a node-group template must declare so node autoscalers simulate our GPU nodes
correctly at zero nodes.

At zero nodes the Cluster Autoscaler and Karpenter know a group only from its template: the labels our plugin
writes and the extended resources it advertises exist only once a node runs it (docs/reference/autoscaling.md 1.4,
2). A pod whose topology needs became required node affinity on our labels (the webhook), or that asks for shared
replicas or MIG devices, would otherwise look unschedulable on every group, and nothing would scale up. This prints
the same labels the publisher computes (gpuplugin.publisher) and the same resource counts the plugin advertises
(gpuplugin.sharing.layout, gpuplugin.sharing.mig_strategy), in the spellings the reference gives:

- `labels`: `key=value` lines (kwok templates, NodePool labels, anything else);
- `aws`: ASG tags `k8s.io/cluster-autoscaler/node-template/label/<k>=<v>` and `.../resources/<r>=<count>`;
- `capi`: Cluster API annotations `capacity.cluster-autoscaler.kubernetes.io/labels` (comma-joined k=v),
  `.../gpu-type` (the resource name) and `.../gpu-count`. The format names one GPU resource: with several (whole
  and shared, MIG profiles), the others cannot be declared, and stderr says which.
- `kubelet`: the kubelet's `--node-labels=k=v,...`, for a node group's kubelet arguments or bootstrap script, so a
  new node carries the labels from its registration. Without them it is, for a few seconds after its GPUs become
  allocatable and before the plugin labels it, a ready node that does not fit a pod asking NVLink or a bandwidth
  floor: an autoscaler loop meanwhile sees the pod still unschedulable and may add a second node. The kubelet may
  only set labels the NodeRestriction admission plugin allows it (KEP-279): none under
  `node-restriction.kubernetes.io`, and under `kubernetes.io` / `k8s.io` (and their subdomains) only the kubelet's
  own (`kubelet.kubernetes.io`, `node.kubernetes.io`); a prefix there is refused here (exit 2) rather than by a
  kubelet that will not start.

`--gpu-label KEY[=VALUE]` adds the cloud provider's GPU label (CA's `GPULabel()`, its `--gpu-label`): CA counts a
node as a GPU node when it carries that label or advertises a known GPU resource (`nvidia.com/gpu`, ...), and reads
the label's value as the GPU type (`--gpu-total` limits, metrics). A node that carries the label while its GPUs
are not yet allocatable is treated as still starting, with the GPU count of its group's template, rather than as
a ready node with no room: without the label on the template and the nodes, a loop in that window may add a
second node. The key is the provider's (reference/autoscaling.md 1.4): AWS `k8s.amazonaws.com/accelerator`, GKE
`cloud.google.com/gke-accelerator`, Azure `kubernetes.azure.com/accelerator`, Cluster API
`cluster-api/accelerator`; with the externalgrpc provider it is whatever the provider's `GPULabel` RPC answers
(CA asks once and keeps the answer). VALUE defaults to the GPU model the plugin labels (`<prefix>/gpu-model`), which
only an NVML recording names; otherwise it must be given.

A Karpenter NodeOverlay is not offered: the reference gives its apiVersion and `spec.capacity`, not how it names
the instance types it applies to, and this command prints only spellings the reference gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from gputopo.contract import DEFAULT_PREFIX, DEFAULT_RESOURCE, Keys, dns_subdomain_problem
from gputopo.core import CoreError, Topology

FORMATS = ("labels", "aws", "capi", "kubelet")
AWS_LABEL_TAG = "k8s.io/cluster-autoscaler/node-template/label/"
AWS_RESOURCE_TAG = "k8s.io/cluster-autoscaler/node-template/resources/"
CAPI_PREFIX = "capacity.cluster-autoscaler.kubernetes.io/"
MIG_STRATEGIES = ("none", "single", "mixed")
# The resources CA knows as GPUs (reference/autoscaling.md 1.5): a node with the GPU label and none of these
# allocatable reads to CA as not ready.
CA_GPU_RESOURCES = ("nvidia.com/gpu", "habana.ai/gaudi", "gpu.intel.com/xe", "amd.com/gpu", "microsoft.com/directx")
_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


class _ExitTwo(click.ClickException):
    exit_code = 2


_KUBERNETES_NAMESPACES = ("kubernetes.io", "k8s.io")
_KUBELET_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")
_NODE_RESTRICTION_NAMESPACE = "node-restriction.kubernetes.io"


def _in_namespace(namespace: str, domain: str) -> bool:
    return namespace == domain or namespace.endswith(f".{domain}")


def kubelet_label_problem(key: str) -> str | None:
    """Why a kubelet may not set label `key` on its own Node under NodeRestriction, or None. Our keys are never
    among the kubelet's well-known labels (hostname, os, arch, zone, ...), so only the namespaces matter here."""
    namespace = key.split("/", 1)[0] if "/" in key else ""
    if _in_namespace(namespace, _NODE_RESTRICTION_NAMESPACE):
        return f"{key}: the {_NODE_RESTRICTION_NAMESPACE} namespace is forbidden to kubelets"
    if (any(_in_namespace(namespace, d) for d in _KUBERNETES_NAMESPACES)
            and not any(_in_namespace(namespace, d) for d in _KUBELET_NAMESPACES)):
        return (f"{key}: kubelets may set no label under kubernetes.io or k8s.io but the kubelet's own; use an "
                "--annotation-prefix outside them")
    return None


def gpu_label(spec: str, labels: dict[str, str], model_key: str) -> tuple[str, str]:
    """(key, value) of `--gpu-label KEY[=VALUE]`, the value defaulting to the template's GPU model label
    (`model_key`): refused (exit 2) here rather than by the cloud's API or the kubelet when the key or value is not
    one Kubernetes accepts, the key is one of ours, or no value is given and the topology names no model."""
    key, sep, value = spec.partition("=")
    prefix, slash, name = key.rpartition("/")
    problem = dns_subdomain_problem(prefix) if slash else None
    if problem or len(name) > 63 or not _LABEL_NAME_RE.match(name):
        raise _ExitTwo(f"--gpu-label: {key!r} is not a label key ([prefix/]name, name at most 63 letters, digits, "
                       f"'-', '_', '.'{'; prefix ' + problem if problem else ''})")
    if key in labels:
        raise _ExitTwo(f"--gpu-label: {key} is one of the plugin's own labels")
    if not sep:
        if model_key not in labels:
            raise _ExitTwo(f"--gpu-label: give {key}=VALUE (the GPU type): the topology file names no GPU model "
                           "(an NVML recording does)")
        value = labels[model_key]
    if value and (len(value) > 63 or not _LABEL_NAME_RE.match(value)):
        raise _ExitTwo(f"--gpu-label: {value!r} is not a label value (at most 63 letters, digits, '-', '_', '.')")
    return key, value


@dataclass(frozen=True)
class NodeTemplate:
    """The labels and extended resources (name -> count) of one node of the group."""

    labels: dict[str, str]
    resources: dict[str, int]


def _read_node(path: str) -> tuple[Topology | None, tuple[Any, ...]]:
    """The whole GPUs' topology (None: every GPU is MIG) and the MIG GPUs of a topology file. Only an NVML
    recording knows about MIG: it is replayed through discovery, as `gpuplugin run` would see the node; the other
    forms give whole GPUs only."""
    from gputopo.discovery.loader import RECORDING_FORMAT, load_topology_file

    try:
        text = Path(path).read_text(encoding="utf-8-sig")
        data = json.loads(text) if text.lstrip().startswith("{") else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        data = None  # not a recording: the loader says what is wrong with it
    gpus = data.get("gpus") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not (data.get("format") == RECORDING_FORMAT or (
            isinstance(gpus, list) and gpus and all(isinstance(g, dict) for g in gpus))):
        return load_topology_file(path), ()
    from gputopo.discovery.nvml import DiscoveryError, discover_node
    from gputopo.discovery.nvml_backend import NvmlError
    from gputopo.discovery.recording import replay_backend

    try:
        found = discover_node(replay_backend(data))
    except DiscoveryError as e:
        if any(m.enabled for m in e.mig):
            return None, e.mig
        raise _ExitTwo(f"{path}: NVML recording gives no usable topology: {e}") from None
    except NvmlError as e:
        raise _ExitTwo(f"{path}: NVML recording cannot be replayed: {e}") from None
    except CoreError as e:
        raise _ExitTwo(f"{path}: {e}" if path not in str(e) else str(e)) from None
    return found.topology, tuple(found.mig)


def build(topology: Topology | None, mig_gpus: tuple[Any, ...], *, keys: Keys, resource_name: str,
          sharing_config: str | None, mig_strategy: str | None) -> NodeTemplate:
    """The template of a node of this topology, as the plugin would label and advertise it."""
    from gpuplugin.publisher import topology_labels

    labels: dict[str, str] = {}
    resources: dict[str, int] = {}
    config = None
    if sharing_config is not None:
        from gpuplugin.sharing.config import read_config

        config = read_config(Path(sharing_config))
    if topology is not None:
        labels.update(topology_labels(keys, topology))
        if config is not None:
            from gpuplugin.sharing.layout import advertised_counts, resolve

            layout = resolve(config, topology, resource_name)
            resources.update(advertised_counts(layout, resource_name))
            for shared in layout.shared:  # an empty node: every shared GPU has a free replica
                key = keys.free_gpus_label(shared.name)
                if key is not None:
                    labels[key] = str(len(shared.gpus))
                one = keys.one_replica_label(shared.name) if shared.fail_requests_greater_than_one else None
                if one is not None:  # the plugin publishes it too: a scale-from-zero template must refuse alike
                    labels[one] = "true"
        else:
            resources[resource_name] = topology.size
    strategy = mig_strategy or (str(config.mig_strategy) if config is not None and config.mig_strategy else None)
    if strategy in ("single", "mixed"):
        if not any(g.enabled for g in mig_gpus):
            raise _ExitTwo(f"--mig-strategy {strategy} needs MIG GPUs: give an NVML recording (gpuplugin record) of "
                           "a node with its MIG layout as --topology")
        from gpuplugin.sharing.mig_strategy import MigStrategy, plan_mig

        plan = plan_mig(MigStrategy(strategy), mig_gpus, topology.size if topology is not None else 0,
                        resource_name)
        if plan.refused:
            raise _ExitTwo(plan.refused)
        for name, count in plan.counts().items():
            resources[name] = resources.get(name, 0) + count
    return NodeTemplate(labels, {k: v for k, v in sorted(resources.items()) if v > 0})


def render(template: NodeTemplate, fmt: str, resource_name: str) -> tuple[list[str], list[str]]:
    """(lines for stdout, warnings for stderr) of one format."""
    labels, resources = template.labels, template.resources
    if fmt == "labels":
        return [f"{k}={v}" for k, v in labels.items()], []
    if fmt == "kubelet":
        problems = [p for p in map(kubelet_label_problem, labels) if p]
        if problems:
            raise _ExitTwo(f"--format kubelet: {problems[0]}")
        return ([f"--node-labels={','.join(f'{k}={v}' for k, v in labels.items())}"] if labels else []), []
    if fmt == "aws":
        return ([f"{AWS_LABEL_TAG}{k}={v}" for k, v in labels.items()]
                + [f"{AWS_RESOURCE_TAG}{r}={n}" for r, n in resources.items()]), []
    lines = [f"{CAPI_PREFIX}labels=" + ",".join(f"{k}={v}" for k, v in labels.items())] if labels else []
    gpu = resource_name if resource_name in resources else next(iter(resources), None)
    if gpu is not None:
        lines += [f"{CAPI_PREFIX}gpu-type={gpu}", f"{CAPI_PREFIX}gpu-count={resources[gpu]}"]
    left = [f"{r}={n}" for r, n in resources.items() if r != gpu]
    warnings = [f"warning: Cluster API annotations declare one GPU resource ({gpu}); not declared: "
                f"{', '.join(left)}"] if left else []
    return lines, warnings


@click.command("node-template")
@click.option("--topology", "topology_file", required=True, type=click.Path(dir_okay=False),
              help="nvidia-smi topo -m text, NVML recording or topology JSON of one node of the group (an NVML "
                   "recording for MIG).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="labels", show_default=True,
              help="labels: key=value lines; aws: ASG node-template tags; capi: Cluster API annotations; kubelet: "
                   "the kubelet's --node-labels, so new nodes carry the labels from registration.")
@click.option("--sharing-config", type=click.Path(dir_okay=False),
              help="The node's GPU sharing config (NVIDIA's device plugin format): shared resources and replicas.")
@click.option("--mig-strategy", type=click.Choice(MIG_STRATEGIES),
              help="How MIG devices are advertised [default: the sharing config's flags.migStrategy, else none].")
@click.option("--resource-name", default=DEFAULT_RESOURCE, show_default=True,
              help="The plugin's resource for whole GPUs (its --resource-name).")
@click.option("--annotation-prefix", default=DEFAULT_PREFIX, show_default=True,
              help="The plugin's --annotation-prefix (prefix of the labels).")
@click.option("--gpu-label", "gpu_label_spec", metavar="KEY[=VALUE]",
              help="Also declare the cloud provider's GPU label, the one Cluster Autoscaler's GPULabel() names: "
                   "k8s.amazonaws.com/accelerator (AWS), cloud.google.com/gke-accelerator (GKE), "
                   "kubernetes.azure.com/accelerator (Azure), cluster-api/accelerator (Cluster API), or what an "
                   "externalgrpc provider's GPULabel RPC answers. VALUE is the GPU type [default: the GPU model "
                   "of an NVML recording].")
def command(topology_file: str, fmt: str, sharing_config: str | None, mig_strategy: str | None, resource_name: str,
            annotation_prefix: str, gpu_label_spec: str | None) -> None:
    """Print the labels and extended resources a node-group template needs for scale from zero."""
    from gputopo.contract import extended_resource_problem
    from gputopo.logs import configure_logging

    configure_logging("error")  # replaying a MIG recording warns per MIG GPU: expected here, not news

    problem = extended_resource_problem(resource_name)
    if problem:
        raise _ExitTwo(f"--resource-name: {problem}")
    try:
        keys = Keys(annotation_prefix)
    except ValueError as e:
        raise _ExitTwo(f"--annotation-prefix: {e}") from None
    try:
        topology, mig_gpus = _read_node(topology_file)
        template = build(topology, mig_gpus, keys=keys, resource_name=resource_name, sharing_config=sharing_config,
                         mig_strategy=mig_strategy)
    except (CoreError, ValueError) as e:  # SharingConfigError is a ValueError
        raise _ExitTwo(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    unready: list[str] = []
    if gpu_label_spec is not None:
        key, value = gpu_label(gpu_label_spec, template.labels, keys.model_label)
        if fmt == "kubelet" and kubelet_label_problem(key):
            raise _ExitTwo(f"--format kubelet: --gpu-label {key}: NodeRestriction lets no kubelet set a label under "
                           "kubernetes.io or k8s.io but its own; leave that label to the provider")
        template = NodeTemplate({**template.labels, key: value}, template.resources)
        if not any(template.resources.get(r, 0) > 0 for r in CA_GPU_RESOURCES):
            unready.append(f"warning: the Cluster Autoscaler counts a node with the GPU label {key} and none of "
                           f"{', '.join(CA_GPU_RESOURCES)} as not ready (ResourceUnready): leave the label off "
                           "such a group")
    lines, warnings = render(template, fmt, resource_name)
    warnings += unready
    if not template.resources:
        warnings.append("warning: a node of this kind advertises no GPU resource (every GPU is MIG and the MIG "
                        "strategy is none): nothing for an autoscaler to scale up for")
    for line in warnings:
        click.echo(line, err=True)
    if lines:
        click.echo("\n".join(lines))
