"""The wire format of kube-scheduler's HTTP extender (k8s.io/kube-scheduler/extender/v1) as pydantic models.

They describe the bodies in the OpenAPI schema and let tests check what the server answers. The hot path does not
validate requests with them (a 5,000-node NodeList through pydantic costs more than the whole filter): extender.wire
reads the few fields it needs from plain dicts and enforces the same shapes.

Keys are PascalCase exactly as kube-scheduler's Go structs (no json tags) produce them; nested Pod and Node objects
are ordinary Kubernetes JSON and keep any key they carry.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel

MIN_SCORE, MAX_SCORE = 0, 10


class _Wire(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class _Kube(BaseModel):
    """Kubernetes JSON: only the fields the extender reads are declared; every other key is kept."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True, extra="allow")


class ObjectMeta(_Kube):
    name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    annotations: dict[str, str] | None = None
    labels: dict[str, str] | None = None
    deletion_timestamp: str | None = Field(default=None, alias="deletionTimestamp")


class NodeMeta(ObjectMeta):
    name: str = Field(min_length=1)  # type: ignore[assignment]  # a Node in a NodeList always has a name


class VictimMeta(ObjectMeta):
    uid: str = Field(min_length=1)  # type: ignore[assignment]  # victims are answered by UID


class Pod(_Kube):
    """A v1 Pod. Read: metadata (uid, name, namespace, annotations), spec containers/initContainers resources."""

    api_version: str | None = Field(default=None, alias="apiVersion")
    kind: str | None = None
    metadata: ObjectMeta | None = None
    spec: dict[str, Any] | None = None
    status: dict[str, Any] | None = None


class Node(_Kube):
    """A v1 Node. Read: metadata (name, annotations), spec.unschedulable, status.allocatable."""

    api_version: str | None = Field(default=None, alias="apiVersion")
    kind: str | None = None
    metadata: NodeMeta
    spec: dict[str, Any] | None = None
    status: dict[str, Any] | None = None


class NodeList(_Kube):
    api_version: str | None = Field(default=None, alias="apiVersion")
    kind: str | None = None
    metadata: dict[str, Any] | None = None
    items: list[Node] | None = None


class VictimPod(Pod):
    metadata: VictimMeta  # type: ignore[assignment]


class ExtenderArgs(_Wire):
    """Body of /filter and /prioritize. nodeCacheCapable: NodeNames set, Nodes null; otherwise the reverse."""

    pod: Pod = Field(alias="Pod")
    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames")


class ExtenderFilterResult(_Wire):
    """Answer of /filter. Only nodes of the request appear; the scheduler reads NodeNames (nodeCacheCapable) or
    Nodes (otherwise) back. Every key is always present; the unused one of Nodes/NodeNames is null."""

    nodes: NodeList | None = Field(alias="Nodes")
    node_names: list[str] | None = Field(alias="NodeNames")
    failed_nodes: dict[str, str] = Field(alias="FailedNodes")
    failed_and_unresolvable_nodes: dict[str, str] = Field(alias="FailedAndUnresolvableNodes")
    error: str = Field(alias="Error")


class HostPriority(_Wire):
    host: str = Field(alias="Host")
    score: int = Field(alias="Score", ge=MIN_SCORE, le=MAX_SCORE, strict=True)


class HostPriorityList(RootModel[list[HostPriority]]):
    """Answer of /prioritize: a bare array, one entry per node of the request, integer scores 0-10."""


class ExtenderBindingArgs(_Wire):
    pod_name: str = Field(alias="PodName", min_length=1)
    pod_namespace: str = Field(alias="PodNamespace", min_length=1)
    pod_uid: str = Field(alias="PodUID")
    node: str = Field(alias="Node", min_length=1)


class ExtenderBindingResult(_Wire):
    """Answer of /bind: Error is "" on success."""

    error: str = Field(alias="Error")


class MetaPod(_Wire):
    uid: str = Field(alias="UID")


class MetaVictims(_Wire):
    pods: list[MetaPod] | None = Field(default=None, alias="Pods")
    num_pdb_violations: int = Field(default=0, alias="NumPDBViolations", ge=0, le=2**31 - 1)


class Victims(_Wire):
    pods: list[VictimPod] | None = Field(default=None, alias="Pods")
    num_pdb_violations: int = Field(default=0, alias="NumPDBViolations", ge=0, le=2**31 - 1)


class ExtenderPreemptionArgs(_Wire):
    """Body of /preempt: victims as full pods, or (nodeCacheCapable) as UIDs."""

    pod: Pod = Field(alias="Pod")
    node_name_to_victims: dict[str, Victims] | None = Field(default=None, alias="NodeNameToVictims")
    node_name_to_meta_victims: dict[str, MetaVictims] | None = Field(default=None, alias="NodeNameToMetaVictims")


class ExtenderPreemptionResult(_Wire):
    """Answer of /preempt: the candidate nodes kept, with their victims as UIDs (unchanged when kept)."""

    node_name_to_meta_victims: dict[str, MetaVictims] | None = Field(alias="NodeNameToMetaVictims")


class ErrorBody(_Wire):
    """Body of a 400 (malformed request) or 413 (too large) answer; kube-scheduler ignores non-200 bodies."""

    error: str = Field(alias="Error")


REQUEST_MODELS: tuple[type[BaseModel], ...] = (ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs)
