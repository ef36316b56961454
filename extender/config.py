"""Settings of `gpu-extender serve`, with the defaults of docs/contracts.md: one pydantic model, loaded by
gputopo.settings (flags > environment `GPU_EXTENDER_<FLAG>` > YAML `--config` file > the defaults below).

The verbs read the names on the cluster and their own limits from it; `serve` the listeners, TLS and credentials.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from extender.membership.owners import OWNER_KINDS
from gputopo.contract import DEFAULT_PREFIX, DEFAULT_RESOURCE, Keys
from gputopo.core.locality import Locality, LocalityError, parse_locality
from gputopo.settings import (
    AnnotationPrefix,
    Cli,
    ExtendedResourceName,
    LogLevel,
    Port,
    ReadableFile,
    SettingsLoader,
    comma_list,
    lease_timing_problem,
)

DEFAULT_BODY_LIMIT = 10 * 1024 * 1024
DEFAULT_RESERVATION_TIMEOUT_S = 60.0
# See extender.placement.engine.island_values; chosen with bench/placement.py.
DEFAULT_ISLAND_PENALTY = 1.0
DEFAULT_ISLAND_SPARE = 4
# kube-scheduler gives a whole exchange 5 s (httpTimeout): a request slower than this to arrive is of no use.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_S = 5.0
DEFAULT_MAX_CONNECTIONS = 1000


class ListenerSettings(BaseModel):
    """What every HTTP listener of ours bounds (extender.http.server): shared by `serve` and `webhook`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    header_timeout_s: Annotated[float, Cli(flag="header-timeout")] = Field(
        DEFAULT_HEADER_TIMEOUT_S, description="Seconds a connection may take, from being ready for a request, to send "
                                              "the request's head; then it is closed.")
    body_timeout_s: Annotated[float, Cli(flag="body-timeout")] = Field(
        DEFAULT_BODY_TIMEOUT_S, description="Seconds a request may take to send its body after its head; then its "
                                            "connection is closed.")
    keep_alive_timeout_s: Annotated[float, Cli(flag="keep-alive-timeout")] = Field(
        DEFAULT_KEEP_ALIVE_S, description="Seconds an idle keep-alive connection is kept after a response.")
    max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS,
        description="Client connections per listener; past it the one waiting longest for a request is closed. "
                    "Lowered to fit the open-files limit.")

    @field_validator("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s")
    @classmethod
    def _timeouts(cls, v: float) -> float:
        if not 0 < v < float("inf"):
            raise ValueError(f"must be a positive number of seconds, got {v}")
        return v

    @field_validator("max_connections")
    @classmethod
    def _max_connections(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v


class ExtenderConfig(ListenerSettings):
    """Validated settings. Field names are the flag names with '_' for '-' (reservation_timeout_s: the flag says
    --reservation-timeout)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: Port = Field(8888, description="Port of the API.")
    inventory: ReadableFile | None = Field(None, description="Standalone mode: nodes from this YAML inventory, "
                                                             "no apiserver.")
    kubeconfig: ReadableFile | None = Field(
        None, description="Kubeconfig file (unset: in-cluster service account, then KUBECONFIG / ~/.kube/config).")
    api_server: str | None = Field(None, description="Explicit apiserver URL (tests, proxies); no credentials.")
    resource_name: ExtendedResourceName = Field(
        DEFAULT_RESOURCE, description="Extended resource whose requests are placed.")
    annotation_prefix: AnnotationPrefix = Field(
        DEFAULT_PREFIX, description="Prefix of every node and pod annotation and label.")
    reservation_timeout_s: Annotated[float, Cli(flag="reservation-timeout")] = Field(
        DEFAULT_RESERVATION_TIMEOUT_S,
        description="Seconds a plan whose Binding was never seen applied holds its GPUs; a bound pod's plan holds "
                    "them until the node shows them used or the pod ends.")
    max_body_bytes: int = Field(DEFAULT_BODY_LIMIT, description="Requests larger than this get 413.")
    island_penalty: float = Field(
        DEFAULT_ISLAND_PENALTY,
        description="Share of a scarce larger NVLink island's GB/s a placement is charged for breaking it; "
                    "0 = greedy.")
    island_spare: int = Field(
        DEFAULT_ISLAND_SPARE,
        description="Equally fast larger islands other nodes must still offer for breaking one to cost nothing.")
    locality: str | None = Field(
        None, description="Network levels from node labels, innermost first, for job plans: "
                          "'rack=key|key@0.5,spine=key,zone=key' (level=label keys, first present wins[@share of "
                          "bandwidth kept crossing it]). Unset: topograph, GKE, EKS and zone labels (docs/jobs.md).")
    job_owner_kinds: Annotated[tuple[str, ...], Cli(metavar="KIND,...")] = Field(
        OWNER_KINDS, description="Owner kinds whose objects size jobs (watched, so granted get/list/watch in RBAC): "
                                 f"any of {','.join(OWNER_KINDS)}; empty: none. A kind not installed is skipped.")
    tls_cert: ReadableFile | None = Field(None, description="Serve HTTPS with this certificate (with --tls-key).")
    tls_key: ReadableFile | None = Field(None, description="The private key of --tls-cert.")
    tls_client_ca: ReadableFile | None = Field(
        None, description="Require client certificates signed by this CA (mutual TLS).")
    allow_insecure_remote: bool = Field(
        False, description="Allow plain HTTP on a non-loopback --host (refused by default: anyone reaching it could "
                           "bind pods).")
    metrics_port: Port = Field(
        0, description="Also serve GET /metrics /healthz /readyz (only those, plain HTTP) on this port; 0: the API "
                       "port only.")
    metrics_host: str = Field(
        "0.0.0.0", description="Address of the --metrics-port listener (read-only, nothing secret: reachable for "
                               "Prometheus and the kubelet's probes).")
    log_level: LogLevel = Field("info", description="Least level logged.")
    consolidate: bool = Field(
        True, description="Among placements of equal value, prefer nodes whose GPUs are already mostly in use, then "
                          "lightly used ones, then empty ones and those an autoscaler marked for removal, so that "
                          "node autoscalers can empty and remove nodes; bandwidth and large free islands still "
                          "come first.")
    filter_best: bool = Field(
        False, description="filter passes only the nodes prioritize would score best (ties kept), so the scheduler "
                           "configuration can leave prioritizeVerb out: one round trip per pod instead of two, "
                           "kube-scheduler's own score plugins choosing among equals (the chart sets both together).")

    dra_driver: str = Field(
        "gpu-topology.io",
        description="DRA driver whose ResourceSlices and ResourceClaims are watched to rank DRA nodes (pods with "
                    "GPU claims, and the configured resource served through a DeviceClass's "
                    "extendedResourceName); empty: not watched, DRA nodes are not ranked.")

    leader_elect: bool = Field(
        False, description="Run for a Lease (coordination.k8s.io) so that several replicas can run: only the holder "
                           "answers and binds, the others keep their watches warm and answer 503 until they win it.")
    leader_elect_lease_name: str = Field("gpu-extender", description="Name of the Lease of --leader-elect.")
    leader_elect_namespace: str | None = Field(
        None, description="Namespace of the Lease and of this replica's Pod; unset: POD_NAMESPACE, else the service "
                          "account's namespace.")
    leader_elect_identity: str | None = Field(
        None, description="This replica's name in the Lease; unset: POD_NAME (else the host name) and a random "
                          "suffix.")
    leader_elect_lease_duration_s: Annotated[int, Cli(flag="leader-elect-lease-duration")] = Field(
        15, description="Seconds a standby waits after the last renewal before taking the Lease.")
    leader_elect_renew_deadline_s: Annotated[int, Cli(flag="leader-elect-renew-deadline")] = Field(
        10, description="Seconds the leader keeps trying to renew before it stops answering and exits.")
    leader_elect_retry_period_s: Annotated[int, Cli(flag="leader-elect-retry-period")] = Field(
        2, description="Seconds between attempts to take or renew the Lease.")

    @field_validator("reservation_timeout_s")
    @classmethod
    def _reservation_timeout(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"reservation timeout must be positive, got {v}")
        return v

    @field_validator("max_body_bytes")
    @classmethod
    def _body_limit(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"body size limit must be positive, got {v}")
        return v

    @field_validator("island_penalty")
    @classmethod
    def _island_penalty(cls, v: float) -> float:
        if not v >= 0:
            raise ValueError(f"island penalty must be 0 or more, got {v}")
        return v

    @field_validator("island_spare")
    @classmethod
    def _island_spare(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"island spare count must be 0 or more, got {v}")
        return v

    @field_validator("job_owner_kinds", mode="before")
    @classmethod
    def _job_owner_kinds(cls, v: Any) -> Any:
        kinds = comma_list(v, "kinds")
        unknown = [k for k in kinds if k not in OWNER_KINDS]
        if unknown:
            raise ValueError(f"unknown owner kind {unknown[0]!r:.80}; known: {', '.join(OWNER_KINDS)}")
        return kinds

    @field_validator("locality")
    @classmethod
    def _locality(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_locality(v)
            except LocalityError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _election(self) -> ExtenderConfig:
        problem = lease_timing_problem(self.leader_elect_lease_duration_s, self.leader_elect_renew_deadline_s,
                                 self.leader_elect_retry_period_s)
        if problem:
            raise ValueError(problem)
        if self.leader_elect and self.inventory is not None:
            raise ValueError("--leader-elect needs a cluster: a standalone --inventory has no Lease to run for")
        return self

    @model_validator(mode="after")
    def _listeners(self) -> ExtenderConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"--metrics-port {self.metrics_port} is the API port: give it a port of its own")
        return self

    @property
    def keys(self) -> Keys:
        return _keys(self.annotation_prefix)

    def network_locality(self) -> Locality:
        """The --locality levels (validated when loaded), or the defaults."""
        return Locality() if self.locality is None else parse_locality(self.locality)


@lru_cache(maxsize=16)
def _keys(prefix: str) -> Keys:
    """Keys validates its prefix when made, and the caches and binder ask for them per watch event (issue 24)."""
    return Keys(prefix)


SETTINGS = SettingsLoader(ExtenderConfig, "GPU_EXTENDER")
