"""The product as the chart deploys it, on a real control plane (tests/helpers/controlplane.py): the extender, the
chart's second kube-scheduler (its profiles and extender stanza, pointed at that extender) and the admission webhook
with the chart's webhook configuration and arguments. Rendered from the chart itself (tests/deploy/rendering), so a
change of the chart's defaults reaches every tier that installs it this way."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from tests.helpers.controlplane import ControlPlane, ExtenderProcess, Proc, Scheduler, start_webhook

SCHEDULER = "gpu-topology-scheduler"
WEBHOOK_ARGS = ("--scheduler-name", "--resource-name", "--annotation-prefix", "--extra-resources",
                "--replica-resources", "--whole-jobs")


@dataclass
class Installed:
    extender: ExtenderProcess
    scheduler: Scheduler
    webhook: Proc


def install_chart(cp: ControlPlane, values: Mapping[str, Any] | None = None, *,
                  extender_args: tuple[str, ...] = ()) -> Installed:
    """Our extender, the chart's second scheduler and its webhook, as the chart with `values` renders them."""
    from tests.deploy.rendering import ChartVariant, render_chart

    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", dict(values or {})))
    extender = cp.start_extender(extra=extender_args)
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-scheduler-config")]
    config = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    (stanza,) = config["extenders"]
    scheduler = cp.start_scheduler([{**stanza, "urlPrefix": extender.url}], name=SCHEDULER,
                                   extra_config={"profiles": config["profiles"]})
    (hook,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-webhook")]
    args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]
            if a.split("=", 1)[0] in WEBHOOK_ARGS]
    webhook = start_webhook(cp, hook["webhooks"][0], *args)
    return Installed(extender, scheduler, webhook)
