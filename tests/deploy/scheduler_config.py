"""Checks of a KubeSchedulerConfiguration against docs/reference/scheduler-extender-api.md.

kube-scheduler decodes its configuration strictly (an unknown field is a startup error), so the known field names
of config/v1 are listed here too: a typo fails the test instead of the scheduler pod.
"""

from __future__ import annotations

import re
from typing import Any

API_VERSION = "kubescheduler.config.k8s.io/v1"
TOP_LEVEL_FIELDS = {
    "apiVersion", "kind", "parallelism", "leaderElection", "clientConnection", "enableProfiling",
    "enableContentionProfiling", "percentageOfNodesToScore", "podInitialBackoffSeconds", "podMaxBackoffSeconds",
    "profiles", "extenders", "delayCacheUntilActive",
}
LEADER_ELECTION_FIELDS = {
    "leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock", "resourceName",
    "resourceNamespace",
}
PROFILE_FIELDS = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}
EXTENDER_FIELDS = {
    "urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb", "enableHTTPS", "tlsConfig",
    "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable",
}
TLS_FIELDS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}
MANAGED_RESOURCE_FIELDS = {"name", "ignoredByScheduler"}
# The extender's routes (docs/contracts.md): POST /filter /prioritize /bind /preempt.
VERBS = {"filterVerb": "filter", "prioritizeVerb": "prioritize", "bindVerb": "bind", "preemptVerb": "preempt"}
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


def _unknown(obj: dict[str, Any], allowed: set[str], where: str) -> list[str]:
    return [f"{where}: unknown field {key!r}" for key in sorted(set(obj) - allowed)]


def problems(config: dict[str, Any], *, resource_name: str, scheduler_name: str,
             node_cache_capable: bool = True, own_scheduler: bool = True) -> list[str]:
    """Everything wrong with `config` as the configuration of a scheduler that uses our extender.

    nodeCacheCapable is expected true (names only: fast at scale); a chart user may turn it off on purpose.
    `own_scheduler`: the configuration of the kube-scheduler we run (not a snippet for someone else's).
    """
    found: list[str] = []
    if config.get("apiVersion") != API_VERSION:
        found.append(f"apiVersion is {config.get('apiVersion')!r}, want {API_VERSION}")
    if config.get("kind") != "KubeSchedulerConfiguration":
        found.append(f"kind is {config.get('kind')!r}")
    found += _unknown(config, TOP_LEVEL_FIELDS, "KubeSchedulerConfiguration")
    found += _unknown(config.get("leaderElection", {}), LEADER_ELECTION_FIELDS, "leaderElection")
    profiles = config.get("profiles", [])
    for profile in profiles:
        found += _unknown(profile, PROFILE_FIELDS, "profiles[]")
    if [p.get("schedulerName") for p in profiles] != [scheduler_name]:
        found.append(f"profiles name {[p.get('schedulerName') for p in profiles]}, want [{scheduler_name!r}]")
    if own_scheduler and config.get("enableProfiling") is not False:
        found.append("enableProfiling must be false (no /debug/pprof on the scheduler's secure port)")
    extenders = config.get("extenders") or []
    if len(extenders) not in (1, 2):
        return [*found, f"want one extender (two with DRA nodes ranked), found {len(extenders)}"]
    if len(extenders) == 2:
        found += dra_entry_problems(extenders[1], extenders[0])
    binders = [e for e in extenders if e.get("bindVerb")]
    if len(binders) != 1:
        found.append(f"want exactly one binder extender, found {len(binders)}")
    ext = extenders[0]
    found += _unknown(ext, EXTENDER_FIELDS, "extenders[0]")
    found += _unknown(ext.get("tlsConfig") or {}, TLS_FIELDS, "extenders[0].tlsConfig")
    for key, verb in VERBS.items():
        if key == "prioritizeVerb" and key not in ext:
            continue  # filter-best: the extender's filter passes the best nodes only, nothing to prioritize
        if ext.get(key) != verb:
            found.append(f"{key} is {ext.get(key)!r}, want {verb!r}")
    weight = ext.get("weight")
    if "prioritizeVerb" in ext and not (isinstance(weight, int) and not isinstance(weight, bool) and weight > 0):
        found.append(f"weight must be an integer > 0 (prioritizeVerb is set), got {weight!r}")
    if ext.get("nodeCacheCapable") is not node_cache_capable:
        want = str(node_cache_capable).lower()
        found.append(f"nodeCacheCapable must be {want} (with true the extender answers from its own node cache)")
    if ext.get("ignorable") is not False:
        found.append("ignorable must be false (GPU pods must not be placed blind to topology)")
    timeout = ext.get("httpTimeout")
    if not (isinstance(timeout, str) and GO_DURATION.match(timeout)):
        found.append(f"httpTimeout {timeout!r} is not a Go duration")
    managed = ext.get("managedResources") or []
    for entry in managed:
        found += _unknown(entry, MANAGED_RESOURCE_FIELDS, "managedResources[]")
    names = [m.get("name") for m in managed]
    # none listed: kube-scheduler asks the extender about every pod (a dedicated scheduler that gets CPU-only job
    # pods too: the chart's webhook.wholeJobs); a snippet for someone else's scheduler must list them
    if (managed or not own_scheduler) and resource_name not in names:
        found.append(f"managedResources {names} lacks {resource_name!r}")
    if len(set(names)) != len(names):
        found.append(f"managedResources {names} names one twice (kube-scheduler refuses the configuration)")
    if any(m.get("ignoredByScheduler") is not False for m in managed):
        found.append("ignoredByScheduler must be false: kube-scheduler keeps counting the GPUs itself")
    url = str(ext.get("urlPrefix", ""))
    https = url.startswith("https://")
    if not (https or url.startswith("http://")):
        found.append(f"urlPrefix {url!r} is not an http(s) URL")
    if bool(ext.get("enableHTTPS", False)) != https:
        found.append(f"enableHTTPS {ext.get('enableHTTPS')!r} disagrees with urlPrefix {url!r}")
    if https:
        tls = ext.get("tlsConfig") or {}
        if tls.get("insecure"):
            found.append("tlsConfig.insecure must not be set")
        if not (tls.get("caFile") or tls.get("caData")):
            found.append("an HTTPS extender needs tlsConfig.caFile/caData to verify the server")
    elif not re.match(r"^http://(127\.0\.0\.1|localhost|\[::1\])(:\d+)?/?$", url):
        found.append(f"plain HTTP is only for the loopback sidecar, got {url!r}")
    return found


def dra_entry_problems(dra: dict[str, Any], main: dict[str, Any]) -> list[str]:
    """The second entry (the chart's gpu-topology.draExtenderEntry, dra.enabled): the same extender asked about
    every pod, so that pods with GPU claims are ranked too; it must not bind, preempt or block scheduling."""
    found = _unknown(dra, EXTENDER_FIELDS, "extenders[1]")
    for key in ("bindVerb", "preemptVerb", "managedResources"):
        if key in dra:
            found.append(f"extenders[1] (DRA nodes) must not set {key}")
    if dra.get("filterVerb") != "filter":
        found.append(f"extenders[1].filterVerb is {dra.get('filterVerb')!r}, want 'filter'")
    if ("prioritizeVerb" in dra) != ("prioritizeVerb" in main):
        found.append("extenders[1] must prioritize exactly when extenders[0] does (filter-best or not)")
    if "prioritizeVerb" in dra and (dra.get("prioritizeVerb") != "prioritize"
                                    or dra.get("weight") != main.get("weight")):
        found.append("extenders[1] must prioritize at /prioritize with extenders[0]'s weight")
    if dra.get("ignorable") is not True:
        found.append("extenders[1].ignorable must be true (pods with claims are placed without it while it is away)")
    for key in ("urlPrefix", "enableHTTPS", "tlsConfig", "nodeCacheCapable", "httpTimeout"):
        if dra.get(key) != main.get(key):
            found.append(f"extenders[1].{key} {dra.get(key)!r} differs from extenders[0]'s {main.get(key)!r}")
    return found
