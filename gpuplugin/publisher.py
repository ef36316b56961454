"""Publishes the node's GPU topology and state on its Node object, for the scheduler extender to read.

What is written (prefix configurable, default gpu-topology.io; see docs/contracts.md):
- annotation `<prefix>/topology`: the core's compact topology JSON, GPU ids = the ids advertised to the kubelet;
  absent on a node whose every GPU is MIG (no whole GPU: the state's "mig" member alone, which the extender reads
  as a MIG-only node; a topology left from an earlier layout is removed);
- annotation `<prefix>/state`: {"v":1,"gen":N,"used":[ids],"unhealthy":[ids]}; `gen` grows by one on every change,
  continuing from the value already on the Node, so it only ever grows across plugin restarts; with `mig=` (issue
  23) also the MIG GPUs and their instances, advertised or not, and which pods hold (gpuplugin.mig_publication);
- labels `<prefix>/fabric` (nvswitch|nvlink|pcie), `<prefix>/gpu-model` (sanitised to a label value),
  `<prefix>/gpu-count`, `<prefix>/allreduce-gbps-<k>` for k = 2..gpu-count: the best all-reduce GB/s (rounded
  down) of k GPUs on the empty node (the extender's `best_possible_gbps`), and on NVLink nodes
  `<prefix>/nvlink-ring-<k>` (true|false): whether k GPUs can ring on NVLink alone. Node autoscalers never call the
  extender and re-run only the in-tree filters, so the webhook turns `min-allreduce-gbps` and `require-nvlink` into node
  affinity on these labels, which real nodes and node-group templates (`gpuplugin node-template`) both carry. All
  of them are removed on a node without whole GPUs, and sizes above the count are removed when it shrinks;
- label `<prefix>/free-gpus.<resource>` per shared resource (time-slicing, MPS): how many of its GPUs have a free
  replica now. A pod asking k replicas needs k distinct GPUs, which the replica count does not say; the webhook
  turns that into node affinity on this label, so kube-scheduler's filter and node autoscalers read it;
- with `autoscaler_hold`, the Cluster Autoscaler's and Karpenter's "do not remove" annotations while the node is
  busy by physical GPUs and their own GPU ratio would misread it (gpuplugin.autoscaler_hold says when and whose);
- with `extra_labels`, the GPU Feature Discovery labels of the shared layout (gpuplugin.sharing.labels); under
  `gfd_labels="auto"` only while the Node carries no GFD_TIMESTAMP, re-decided on the Node as each step reads it.
  GFD labels the same keys, and two writers would flip them for ever; when GFD appears the plugin stops writing and
  removes nothing (the keys are GFD's now), and it never removes a key it did not write itself in this run;
- with `config_refusal` (sharing configured), the Node condition GPUSharingConfigValid (False with the reason while
  the sharing config asked for is refused, True once one is served) and a Warning Event SharingConfigRefused once
  per distinct refusal, so a refused config shows in `kubectl describe node`, not only in the plugin's log. The
  condition is decided on the Node's status as read, the Event on the last refusal reported (a restarted plugin
  takes it from the condition): neither is sent again on every poll.

Why it behaves as it does:
- "used" comes from the kubelet's PodResources API on every poll, never from memory: after a restart the state is
  rebuilt from what the kubelet actually holds. When PodResources cannot be read, nothing is published rather
  than a guess (an empty "used" would invite the extender to double-book GPUs).
- A patch goes out only when a value differs from what the Node carries (read once at start, then kept from each
  patch reply), one at a time (one thread) and at most once per `min_interval_s`; changes arriving meanwhile are
  coalesced into the next patch.
- PodResources is read every `poll_interval_s`, and every `follow_poll_s` for a while after a GPU pod ended
  (`trigger(follow_s)`): the kubelet lists an ended pod's devices until it has processed the end itself, a moment
  after the API said so, and the release is published as soon as the kubelet's list shows it, not at the next slow
  poll (issue 20: a force-deleted pod's GPUs were published as used for about a second, and the scheduler picked
  around them). The kubelet serves PodResources locally and allows 100 calls/s; a window costs
  follow_s / follow_poll_s calls.
- API errors are retried with exponential backoff: 5xx, 429, 409 and no-answer promptly; 404 (the Node does not
  exist yet, e.g. the plugin started before the kubelet registered it), 401/403 (RBAC) and 422 are logged and
  retried at the slow end of the backoff.

RBAC it needs (the smallest that works; resourceNames cannot name "my own node" in a DaemonSet):
    apiVersion: rbac.authorization.k8s.io/v1
    kind: ClusterRole
    rules:
    - apiGroups: [""]
      resources: ["nodes"]
      verbs: ["get", "patch"]
    # with sharing configured: the config condition and its Events
    - apiGroups: [""]
      resources: ["nodes/status"]
      verbs: ["patch"]
    - apiGroups: [""]
      resources: ["events"]
      verbs: ["create"]
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, Self

import kubernetes.client
import structlog

from gpuplugin.autoscaler_hold import DEFAULT_THRESHOLD, AutoscalerHold, GpuUsage, gpu_usage, parse_owned
from gpuplugin.podresources import PodResourcesError
from gpuplugin.sharing.labels import GFD_TIMESTAMP
from gputopo.contract import NVLINK_FABRICS, Keys
from gputopo.core.allocator import best_possible_gbps, nvlink_ring_sizes
from gputopo.core.codec import Mig, NodeState, Sharing, state_from_json, state_to_json, topology_to_json
from gputopo.core.errors import TopologyFormatError
from gputopo.core.topology import Topology
from gputopo.kube.errors import Conflict, KubeApiError, NotFound
from gputopo.kube.fetching import get_node
from gputopo.kube.patching import node_condition, patch_node_condition, patch_node_metadata, post_node_event
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
_LABEL_VALUE_MAX = 63

IdsProvider = Callable[[], Iterable[str]]

CONFIG_CONDITION = "GPUSharingConfigValid"
CONFIG_REFUSED = "SharingConfigRefused"
CONFIG_ACCEPTED = "SharingConfigAccepted"
EVENT_COMPONENT = "gpu-topology-plugin"
_UNSET = object()


def sanitize_label_value(value: str) -> str:
    """A valid label value: runs of other characters become '-', ends trimmed to alphanumerics, at most 63."""
    text = _LABEL_VALUE_BAD.sub("-", value.strip())[:_LABEL_VALUE_MAX]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", text)


def allreduce_labels(keys: Keys, topology: Topology) -> dict[str, str]:
    """`<prefix>/allreduce-gbps-<k>` for k = 2..size: the empty node's best all-reduce GB/s, rounded down, so a
    requirement `Gt min-1` on an integer label never admits a node below the pod's floor."""
    return {keys.allreduce_label(k): str(math.floor(best_possible_gbps(topology, k)))
            for k in range(2, topology.size + 1)}


def topology_labels(keys: Keys, topology: Topology) -> dict[str, str]:
    """Every label a node of `topology` carries (no model label when NVML names no model): what the publisher
    keeps on the Node and what `gpuplugin node-template` prints for node-group templates, from one function."""
    models = {g.model for g in topology.gpus if g.model}
    model = sanitize_label_value(models.pop()) if len(models) == 1 else ("mixed" if models else "")
    return {
        keys.fabric_label: topology.fabric,
        **({keys.model_label: model} if model else {}),
        keys.count_label: str(topology.size),
        **allreduce_labels(keys, topology),
        **nvlink_ring_labels(keys, topology),
    }


def nvlink_ring_labels(keys: Keys, topology: Topology) -> dict[str, str]:
    """`<prefix>/nvlink-ring-<k>` for k = 2..size on a node with NVLink: whether k GPUs can ring on NVLink alone,
    which the fabric label does not say (bridge pairs, cube meshes). None on a PCIe-only node: its fabric label
    already keeps `require-nvlink` pods away."""
    if topology.fabric not in NVLINK_FABRICS:
        return {}
    sizes = nvlink_ring_sizes(topology)
    return {keys.nvlink_ring_label(k): "true" if k in sizes else "false" for k in range(2, topology.size + 1)}


def replica_labels(keys: Keys, state: NodeState) -> dict[str, str]:
    """Per shared resource, how many of its healthy GPUs have a free replica (Keys.free_gpus_label): changes as
    pods come and go, unlike the topology labels; and, while the sharing config sets failRequestsGreaterThanOne,
    Keys.one_replica_label. Both are decided on the state each time: a label of a resource or flag gone is removed."""
    if state.sharing is None:
        return {}
    out = {}
    for res in state.sharing.resources:
        key = keys.free_gpus_label(res.name)
        if key is not None:
            out[key] = str(sum(1 for g in res.gpus if g.used < g.replicas and g.gpu not in state.unhealthy))
        # failRequestsGreaterThanOne: no count says the node refuses a container asking 2 (Keys.one_replica_label)
        one = keys.one_replica_label(res.name) if state.sharing.fail_requests_greater_than_one else None
        if one is not None:
            out[one] = "true"
    return out


def relabel(topology: Topology, device_ids: Sequence[str]) -> Topology:
    """The same topology with GPU ids replaced by the advertised device ids (index strategy: "0", "1", ...)."""
    if len(device_ids) != topology.size:
        raise ValueError(f"{len(device_ids)} device ids for a topology of {topology.size} GPUs")
    if tuple(device_ids) == topology.ids:
        return topology
    gpus = [dataclasses.replace(g, id=d) for g, d in zip(topology.gpus, device_ids, strict=True)]
    return Topology.build(gpus, topology.links, topology.nics, topology.pcie_generation, topology.socket_link_gbps)


class NodePublisher(Worker):
    """Keeps `<prefix>/topology`, `<prefix>/state` and the labels of one Node current. `start()` runs it in a
    thread polling every `poll_interval_s`; `trigger()` (health changes) publishes at once, rate limits allowing.
    `publish_once()` is the same step, synchronously, raising what went wrong."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        node_name: str,
        keys: Keys,
        topology: Topology | None,
        device_ids: Sequence[str] | None,
        used_ids: IdsProvider,
        unhealthy_ids: IdsProvider,
        *,
        poll_interval_s: float = 10.0,
        min_interval_s: float = 0.2,
        follow_poll_s: float = 0.05,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 60.0,
        resync_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        sharing: Callable[[], Sharing | None] | None = None,
        extra_labels: Callable[[], Mapping[str, str | None]] | None = None,
        mig: Callable[[], Mig | None] | None = None,
        autoscaler_hold: AutoscalerHold | None = None,
        gfd_labels: bool | Literal["auto"] = True,
        config_refusal: Callable[[], str | None] | None = None,
    ) -> None:
        if not node_name:
            raise ValueError("node name is required to publish (set NODE_NAME from the downward API)")
        super().__init__("node-publisher")
        self._api = api
        self.node_name = node_name
        self.keys = keys
        self.topology = relabel(topology, device_ids) if device_ids is not None and topology is not None else topology
        # Health monitors and the kubelet may name GPUs by UUID or by advertised id: accept both.
        whole = (topology.gpus, self.topology.gpus) if topology is not None and self.topology is not None else ((), ())
        self._to_id: dict[str, str] = {g.id: a.id for g, a in zip(*whole, strict=True)}
        self._to_id.update({a.id: a.id for a in whole[1]})
        self._used_ids = used_ids
        self._unhealthy_ids = unhealthy_ids
        self._poll = poll_interval_s
        self._min_interval = min_interval_s
        self._follow_poll = follow_poll_s
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._resync = resync_s
        self._clock = clock
        self._follow_until: float | None = None
        self._sharing = sharing  # the state's "sharing" member, from PodResources (issue 22)
        self._extra_labels = extra_labels  # the GFD labels of the shared layout
        self._gfd_mode = gfd_labels  # True: always write them; "auto": while GFD does not label the Node
        self._gfd_running = False  # the Node, as last read, carries GFD_TIMESTAMP
        self._gfd_written: set[str] = set()  # GFD keys this run set a value for: the only ones it may remove
        self._config_refusal = config_refusal  # why the sharing config is refused now, None while it is served
        self._condition: dict[str, Any] | None = None  # CONFIG_CONDITION as the Node last carried it
        self._node_uid: str | None = None
        self._event_posted: Any = _UNSET  # the refusal last posted as an Event (None: none since one was served)
        self._report_error: str | None = None  # the last failure to report, logged once
        self._mig = mig  # the state's "mig" member (gpuplugin.mig_publication.mig_block), issue 23
        self._hold = autoscaler_hold
        # every size's label is one of these stems + the size: stale sizes on the Node are found by them
        self._size_stems = (keys.allreduce_label(1).removesuffix("1"), keys.nvlink_ring_label(1).removesuffix("1"))

        self.topology_key = keys.topology
        self.state_key = keys.state
        self._topology_json = topology_to_json(self.topology) if self.topology is not None else None
        self._labels = self._desired_labels()

        self._observed: dict[str, str | None] | None = None  # our keys as the Node last carried them
        self._observed_allreduce: frozenset[str] = frozenset()  # allreduce-gbps-<k>, nvlink-ring-<k> on the Node
        self._observed_replicas: frozenset[str] = frozenset()  # free-gpus / one-replica-per-container labels on it
        self._observed_rv: str | None = None
        self._observed_at = 0.0
        self._last_patch_at: float | None = None
        self._state: NodeState | None = None
        self._cond = threading.Condition()

    # --- what should be on the Node -----------------------------------------------------------------------------

    def _desired_labels(self) -> dict[str, str | None]:
        if self.topology is None:  # no whole GPU: the whole-GPU labels do not apply
            return {self.keys.fabric_label: None, self.keys.model_label: None, self.keys.count_label: None}
        labels: dict[str, str | None] = {self.keys.model_label: None}
        labels.update(topology_labels(self.keys, self.topology))  # static: computed once, here
        return labels

    def _is_sized_label(self, key: str) -> bool:
        """allreduce-gbps-<k> or nvlink-ring-<k>: one label per size, so a smaller node leaves some stale."""
        for stem in self._size_stems:
            size = key.removeprefix(stem)
            if size != key and size.isdigit():
                return True
        return False

    def _ids(self, provider: IdsProvider, what: str) -> frozenset[str]:
        out, foreign = set(), []
        for x in provider():
            mapped = self._to_id.get(x)
            if mapped is None:
                foreign.append(x)
            else:
                out.add(mapped)
        if foreign:
            log.debug("plugin.publish.ids_ignored", what=what, ids=sorted(foreign)[:8], why="not a GPU of this plugin")
        return frozenset(out)

    def _desired_state(self, current: str | None) -> tuple[str, NodeState]:
        used = self._ids(self._used_ids, "used")
        mig = self._mig() if self._mig is not None else None
        raw_unhealthy = list(self._unhealthy_ids())
        # MIG UUIDs of the published instances are ids of this plugin too (the extender skips unhealthy instances)
        instances = {i.uuid for g in mig.gpus for i in g.instances} if mig is not None else set()
        unhealthy = self._ids(lambda: [x for x in raw_unhealthy if x not in instances], "unhealthy")
        unhealthy |= frozenset(x for x in raw_unhealthy if x in instances)
        previous: NodeState | None = None
        if current is not None:
            try:
                previous = state_from_json(current)
            except TopologyFormatError as e:
                log.warning("plugin.publish.state_unreadable", node=self.node_name, error=str(e), action="overwrite")
        sharing = self._sharing() if self._sharing is not None else None
        used -= sharing.shared_gpus if sharing is not None else frozenset()
        if (previous is not None and previous.used == used and previous.unhealthy == unhealthy
                and previous.sharing == sharing and previous.mig == mig):
            return current or "", previous
        state = NodeState((previous.generation if previous else 0) + 1, used, unhealthy, sharing, mig)
        return state_to_json(state), state

    def _writes_gfd(self) -> bool:
        return self._extra_labels is not None and (self._gfd_mode is True
                                                   or (self._gfd_mode == "auto" and not self._gfd_running))

    def _gfd_wanted(self) -> dict[str, str | None]:
        if not self._writes_gfd():
            return {}  # stop writing, remove nothing: GFD may own these keys now
        assert self._extra_labels is not None
        extra = dict(self._extra_labels())
        if self._gfd_mode == "auto":  # a removal only of a key this run wrote: another writer's stays
            extra = {k: v for k, v in extra.items() if v is not None or k in self._gfd_written}
        return extra

    def _all_labels(self) -> dict[str, str | None]:
        extra = self._gfd_wanted()
        # sizes the Node carries from an earlier layout (more whole GPUs, or any before every GPU went MIG)
        stale = {k: None for k in self._observed_allreduce if k not in self._labels}
        return {**stale, **self._labels, **extra}

    def _usage(self, state: NodeState) -> GpuUsage:
        return gpu_usage(state, self.topology.ids if self.topology is not None else ())

    # --- one step -----------------------------------------------------------------------------------------------

    def _observe(self, node: Mapping[str, Any]) -> None:
        meta = node.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        labels = meta.get("labels") or {}
        gfd_running = GFD_TIMESTAMP in labels  # before _all_labels(): it decides which keys are ours
        if gfd_running != self._gfd_running and self._extra_labels is not None and self._gfd_mode == "auto":
            log.info("plugin.publish.gfd_labels", node=self.node_name, writing=not gfd_running,
                     why=f"{GFD_TIMESTAMP} {'found' if gfd_running else 'absent'}: GPU Feature Discovery "
                         f"{'labels' if gfd_running else 'does not label'} this node")
        self._gfd_running = gfd_running
        self._node_uid = meta.get("uid")
        self._condition = node_condition(node, CONFIG_CONDITION)
        if self._event_posted is _UNSET:  # a restart: the refusal the condition shows was posted already
            c = self._condition
            self._event_posted = c.get("message") if c is not None and c.get("status") == "False" else None
        observed: dict[str, str | None] = {
            self.topology_key: annotations.get(self.topology_key),
            self.state_key: annotations.get(self.state_key),
        }
        if self._hold is not None:
            observed.update({k: annotations.get(k) for k in self._hold.annotation_keys})
        self._observed_allreduce = frozenset(k for k in labels if self._is_sized_label(k))
        self._observed_replicas = frozenset(k for k in labels if self.keys.is_free_gpus_label(k)
                                            or self.keys.is_one_replica_label(k))
        observed.update({k: labels.get(k) for k in self._observed_replicas})
        observed.update({k: labels.get(k) for k in self._all_labels()})
        self._observed = observed
        self._observed_at = self._clock()
        self._observed_rv = meta.get("resourceVersion")

    def _plan(self) -> tuple[NodeState, dict[str, str | None], dict[str, str | None], dict[str, str | None]]:
        """The state, and what differs from the Node: our annotations, our labels, the autoscaler hold's."""
        assert self._observed is not None
        observed = self._observed
        state_json, state = self._desired_state(observed.get(self.state_key))
        annotations = {self.topology_key: self._topology_json, self.state_key: state_json}
        ann_diff = {k: v for k, v in annotations.items() if observed.get(k) != v}
        replicas = replica_labels(self.keys, state)
        labels = {**self._all_labels(), **{k: None for k in self._observed_replicas}, **replicas}
        label_diff = {k: v for k, v in labels.items() if observed.get(k) != v}
        hold = self._hold.desired(self._usage(state), observed) if self._hold is not None else {}
        hold_diff = {k: v for k, v in hold.items() if observed.get(k) != v}
        return state, ann_diff, label_diff, hold_diff

    def publish_once(self) -> bool:
        """Bring the Node up to date; True when a patch was sent. Raises KubeApiError or PodResourcesError."""
        fresh = False
        if self._observed is None or self._clock() - self._observed_at >= self._resync:
            self._observe(get_node(self._api, self.node_name))
            fresh = True
        self._report_config()  # before _plan(): it does not wait on PodResources
        state, ann_diff, label_diff, hold_diff = self._plan()
        if hold_diff and not fresh:
            # The autoscaler annotations are shared with people: decide on the Node as it is now, not as the last
            # patch reply showed it, and send the change conditional on that version (a 409 re-reads and retries).
            self._observe(get_node(self._api, self.node_name))
            state, ann_diff, label_diff, hold_diff = self._plan()
        if not ann_diff and not label_diff and not hold_diff:
            self._set_state(state)
            return False
        held_before = parse_owned(self._observed.get(self._hold.owner_key)) if self._hold is not None else None
        try:
            node = patch_node_metadata(
                self._api, self.node_name, annotations={**ann_diff, **hold_diff} or None,
                labels=label_diff or None, resource_version=self._observed_rv if hold_diff else None,
            )
        except KubeApiError:
            self._observed = None  # re-read before the next try: the Node may have changed or gone
            raise
        self._last_patch_at = self._clock()
        gfd = self._gfd_wanted().keys()
        self._gfd_written |= {k for k in label_diff if k in gfd and label_diff[k] is not None}
        self._gfd_written -= {k for k in label_diff if label_diff[k] is None}
        self._observe(node)
        self._set_state(state)
        if self._hold is not None and held_before is not None:
            self._log_hold(state, held_before, parse_owned(self._observed.get(self._hold.owner_key)))
        log.info(
            "plugin.publish.done",
            node=self.node_name,
            generation=state.generation,
            used=len(state.used),
            unhealthy=sorted(state.unhealthy),
            keys=sorted([*ann_diff, *label_diff, *hold_diff]),
        )
        return True

    def _report_config(self) -> None:
        """The sharing config's condition and Event (see the module's docstring). A failure here (RBAC of an older
        install) is logged once and retried at the next step; publication goes on without it."""
        if self._config_refusal is None:
            return
        refusal = self._config_refusal()
        try:
            if refusal is not None and refusal != self._event_posted:
                post_node_event(self._api, {"metadata": {"name": self.node_name, "uid": self._node_uid}},
                                reason=CONFIG_REFUSED, message=refusal, component=EVENT_COMPONENT)
                log.info("plugin.sharing.refusal_reported", node=self.node_name, reason=refusal)
            self._event_posted = refusal
            status, reason = (False, CONFIG_REFUSED) if refusal is not None else (True, CONFIG_ACCEPTED)
            message = refusal or "the sharing config asked for is served"
            c = self._condition or {}
            wanted = ("True" if status else "False", reason, message)
            if (c.get("status"), c.get("reason"), c.get("message")) != wanted:
                node = patch_node_condition(self._api, self.node_name, condition_type=CONFIG_CONDITION,
                                            status=status, reason=reason, message=message,
                                            transitioned=c.get("status") != wanted[0])
                self._condition = node_condition(node, CONFIG_CONDITION)
        except KubeApiError as e:
            error = f"{e.status} {e.reason}: {e.message}"
            if error != self._report_error:
                hint = "check the ClusterRole: patch on nodes/status, create on events" if e.status == 403 else ""
                log.warning("plugin.sharing.report_failed", node=self.node_name, error=error, hint=hint,
                            action="retried at the next publication")
            self._report_error = error
            return
        self._report_error = None

    def _log_hold(self, state: NodeState, before: frozenset[str], after: frozenset[str]) -> None:
        if bool(before) == bool(after):
            return
        assert self._hold is not None
        usage = self._usage(state)
        fields = {"node": self.node_name, "share": round(usage.share, 3), "busy_gpus": usage.busy,
                  "gpus": usage.total, "threshold": self._hold.threshold, "annotations": sorted(after or before)}
        if after:
            log.info("plugin.autoscaler_hold.set", **fields)
        else:
            log.info("plugin.autoscaler_hold.lifted", **fields)

    def _set_state(self, state: NodeState) -> None:
        with self._cond:
            self._state = state
            self._cond.notify_all()

    # --- the thread ---------------------------------------------------------------------------------------------

    @property
    def state(self) -> NodeState | None:
        """The state the Node carries as of the last successful step."""
        with self._cond:
            return self._state

    def wait_for_state(self, predicate: Callable[[NodeState], bool], timeout: float) -> bool:
        """Block until a published state satisfies `predicate` (tests, the demo)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._state is not None and predicate(self._state), timeout)

    def trigger(self, follow_s: float = 0.0) -> None:
        """Publish soon (a health change, a pod that ended): immediately, unless a patch went out less than
        min_interval_s ago; with `follow_s`, keep reading PodResources every follow_poll_s for that long, publishing
        each change as it shows (the kubelet may still list an ended pod's devices for a moment after the API says
        it ended)."""
        if follow_s > 0:
            until = self._clock() + follow_s
            self._follow_until = until if self._follow_until is None else max(self._follow_until, until)
        self.wake()

    def loop(self) -> None:
        delay = 0.0
        while not self.pause(delay):
            if self._last_patch_at is not None:
                wait = self._min_interval - (self._clock() - self._last_patch_at)
                if wait > 0 and self.pause(wait, wakeable=False):  # coalesce whatever arrives meanwhile
                    break
            try:
                self.publish_once()
            except PodResourcesError as e:
                delay = min(self._poll, self._backoff.failed())
                log.warning(
                    "plugin.publish.podresources_failed",
                    error=str(e),
                    retry_in_s=round(delay, 3),
                    action="state left as published",
                )
                continue
            except KubeApiError as e:
                delay = self._delay_for(e)
                continue
            except Exception:
                delay = self._backoff.failed()
                log.exception("plugin.publish.failed", retry_in_s=round(delay, 3))
                continue
            self._backoff.reset()
            delay = self._poll
            follow = self._follow_until
            if follow is not None:
                if self._clock() < follow:
                    delay = min(delay, self._follow_poll)
                else:
                    self._follow_until = None

    def _delay_for(self, e: KubeApiError) -> float:
        if e.retryable or isinstance(e, Conflict):
            delay = self._backoff.failed()
            log.warning(
                "plugin.publish.retrying", node=self.node_name, status=e.status, reason=e.reason,
                retry_in_s=round(delay, 3),
            )
            return delay
        delay = max(self._backoff.failed(), min(self._poll, self._backoff.max_s))
        if isinstance(e, NotFound):
            log.warning(
                "plugin.publish.node_missing",
                node=self.node_name,
                retry_in_s=round(delay, 3),
                hint="the kubelet has not registered this Node yet, or NODE_NAME is wrong",
            )
        else:
            log.error(
                "plugin.publish.api_error",
                node=self.node_name,
                status=e.status,
                reason=e.reason,
                message=e.message,
                retry_in_s=round(delay, 3),
                hint="check the ClusterRole: get and patch on nodes" if e.status in (401, 403) else "",
            )
        return delay


class _ManagerLike(Protocol):
    """What publication reads from the device plugin's ResourceManager."""

    topology: Topology

    @property
    def devices(self) -> Sequence[Any]: ...
    def unhealthy_ids(self) -> list[str]: ...
    def subscribe(self) -> Any: ...
    def unsubscribe(self, sub: Any) -> None: ...


class _ConfigLike(Protocol):
    node_name: str | None
    keys: Keys
    resource_name: str
    pod_resources_socket: Any


class Publication(Worker):
    """A running NodePublisher wired to the plugin: used ids from PodResources, unhealthy ids from the resource
    manager, and a trigger on every device list change (health), forwarded by this worker's thread. `stop()` ends
    both and closes their clients."""

    def __init__(self, publisher: NodePublisher, manager: _ManagerLike | None,
                 closers: Sequence[Callable[[], None]], *, on_stop: Callable[[], None] | None = None):
        super().__init__("publisher-trigger")
        self.publisher = publisher
        self._manager = manager  # None: no whole GPU (a MIG-only node), nothing to forward
        self._closers = list(closers)
        self._on_stop = on_stop  # after the last patch, before the clients close (gpuplugin.node_cleanup)
        self._sub = manager.subscribe() if manager is not None else None

    def start(self) -> Self:
        self.publisher.start()
        return super().start() if self._sub is not None else self

    def loop(self) -> None:
        while self._sub is not None and self._sub.next() is not None:
            self.publisher.trigger()

    def interrupt(self) -> None:
        if self._manager is not None:
            self._manager.unsubscribe(self._sub)  # ends the subscription's next() with None

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        self.publisher.stop()
        if self._on_stop is not None:
            try:
                self._on_stop()
            except Exception:
                log.exception("plugin.cleanup.failed", action="keys left on the node")
        for close in self._closers:
            try:
                close()
            except Exception:
                log.debug("plugin.publish.close_failed", exc_info=True)


def start_publisher(
    cfg: _ConfigLike, manager: _ManagerLike | None, *, api: kubernetes.client.ApiClient | None = None,
    unhealthy: IdsProvider | None = None, **options: Any
) -> Publication | None:
    """Publication for `gpuplugin run`; None (said once in the log) when no API client can be made. `manager`
    None: a node without whole GPUs, publishing its state (the `mig=` member) without a topology. `unhealthy`: the
    unhealthy ids when more than the manager's (MIG UUIDs). The autoscaler hold runs at the settings'
    `autoscaler_busy_threshold` (0: off, lifting a hold this plugin set)."""
    from gpuplugin.podresources import PodResourcesClient
    from gputopo.kube.client import KubeConfigError, make_api_client

    closers: list[Callable[[], None]] = []
    if api is None:
        try:
            api = make_api_client()
        except KubeConfigError as e:
            log.warning("plugin.publish.off", reason="no usable Kubernetes credentials", error=str(e))
            return None
        closers.append(api.close)
    pods = PodResourcesClient(str(cfg.pod_resources_socket))
    closers.append(pods.close)
    resource = cfg.resource_name
    # settings objects of tests and older callers may lack it: the hold is then on at CA's own threshold
    threshold = getattr(cfg, "autoscaler_busy_threshold", DEFAULT_THRESHOLD)
    options.setdefault("autoscaler_hold", AutoscalerHold(cfg.keys, threshold))
    options.setdefault("gfd_labels", getattr(cfg, "sharing_labels", True))
    if options.get("sharing") is not None and hasattr(manager, "refused"):
        # sharing is configured: the node's refusal of its config becomes a Node condition and Event
        options.setdefault("config_refusal", lambda: manager.refused)
    publisher = NodePublisher(
        api,
        cfg.node_name or "",
        cfg.keys,
        manager.topology if manager is not None else None,
        None if manager is None else
        [d.id for d in (manager.all_devices if hasattr(manager, "all_devices") else manager.devices)],
        lambda: pods.used_ids(resource),
        unhealthy or (manager.unhealthy_ids if manager is not None else tuple),
        **options,
    )
    log.info(
        "plugin.publish.on", node=cfg.node_name, prefix=cfg.keys.prefix, pod_resources=str(cfg.pod_resources_socket)
    )
    from gpuplugin.node_cleanup import stop_leaver

    # a container's hostname is its Pod's name; POD_NAME (downward API) wins where a pod sets its own hostname
    pod_name = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME")
    leave = stop_leaver(api, cfg.node_name or "", cfg.keys, pod_name)
    return Publication(publisher, manager, closers, on_stop=leave).start()
