"""Settings of `gpu-extender webhook`: one pydantic model, loaded by gputopo.settings (flags > environment
`GPU_EXTENDER_WEBHOOK_<FLAG>` > YAML `--config` file > the defaults below)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from extender.config import ListenerSettings
from gputopo.contract import DEFAULT_PREFIX, DEFAULT_RESOURCE, Keys, dns_subdomain_problem, extended_resource_problem
from gputopo.settings import (
    AnnotationPrefix,
    Cli,
    ExtendedResourceName,
    LogLevel,
    Port,
    ReadableFile,
    SettingsLoader,
    comma_list,
)

DEFAULT_SCHEDULER_NAME = "gpu-topology-scheduler"
# An AdmissionReview carries the pod once (oldObject is null on CREATE); the API server refuses request bodies over
# 3 MiB, so a review of any pod it accepted fits in 4 MiB.
DEFAULT_WEBHOOK_BODY_LIMIT = 4 * 1024 * 1024


class WebhookConfig(ListenerSettings):
    """Validated settings; field names are the flag names with '_' for '-'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("0.0.0.0", description="Address to listen on (HTTPS only).")
    port: Port = Field(8443, description="HTTPS port the API server calls (POST /mutate).")
    tls_cert: ReadableFile | None = Field(
        None, description="Serving certificate (required: the API server calls webhooks over HTTPS only); reloaded "
                          "when the file changes.")
    tls_key: ReadableFile | None = Field(None, description="The private key of --tls-cert (required).")
    scheduler_name: str = Field(DEFAULT_SCHEDULER_NAME, description="schedulerName given to the pods it manages.")
    resource_name: ExtendedResourceName = Field(
        DEFAULT_RESOURCE, description="Extended resource whose pods it manages.")
    extra_resources: Annotated[tuple[str, ...], Cli(metavar="DOMAIN/NAME,...")] = Field(
        (), description="More extended resources whose pods it manages, besides --resource-name, its shared name "
                        "(<name>.shared) and the MIG names of its domain: the names GPU sharing configs advertise "
                        "under `rename` (the chart passes those of its configs and plugin.sharing.resourceNames).")
    annotation_prefix: AnnotationPrefix = Field(
        DEFAULT_PREFIX, description="Prefix of the opt-out label <prefix>/webhook=disabled on pods.")
    whole_jobs: bool = Field(
        False, description="Also manage the pods of a Kubeflow job (label training.kubeflow.org/job-name) that ask no "
                           "GPUs, such as a TFJob's parameter servers: the extender puts them in the rack of the "
                           "job's workers.")
    replica_resources: Annotated[tuple[str, ...], Cli(metavar="DOMAIN/NAME,...")] = Field(
        (), description="Names GPU sharing configs advertise as replicas (the chart passes those of its configs): a "
                        "pod asking k of one needs k GPUs with a free replica, added as node affinity on the "
                        "plugin's <prefix>/free-gpus.<name> label; --resource-name here (a config that does not "
                        "rename it) gets it as an alternative to the label being absent (whole-GPU nodes).")
    dra_claims: bool = Field(
        False, description="Also manage pods with resource claims (DRA mode; the chart sets it with dra.enabled): "
                           "the extender ranks the DRA nodes for them, which only the topology-aware scheduler "
                           "asks it.")
    topology_affinity: bool = Field(
        True, description="Add a pod's require-nvlink and min-allreduce-gbps annotations as required node affinity "
                          "on the plugin's node labels (<prefix>/fabric, <prefix>/allreduce-gbps-<k>), so node "
                          "autoscalers, which skip the extender, add the right nodes for it.")
    max_body_bytes: int = Field(DEFAULT_WEBHOOK_BODY_LIMIT, description="Requests larger than this get 413.")
    certificate_check_s: Annotated[float, Cli(flag="certificate-check-interval")] = Field(
        10.0, description="Seconds between checks of --tls-cert/--tls-key for a renewed certificate.")
    metrics_port: Port = Field(
        0, description="Also serve GET /metrics /healthz /readyz (only those, plain HTTP) on this port; 0: the HTTPS "
                       "port only.")
    metrics_host: str = Field("0.0.0.0", description="Address of the --metrics-port listener.")
    log_level: LogLevel = Field("info", description="Least level logged.")

    @field_validator("scheduler_name")
    @classmethod
    def _scheduler_name(cls, v: str) -> str:
        problem = dns_subdomain_problem(v)  # the API server validates spec.schedulerName as a DNS subdomain
        if problem:
            raise ValueError(f"scheduler name {problem}")
        if v == "default-scheduler":
            raise ValueError("the scheduler name must be the topology-aware scheduler's, not default-scheduler")
        return v

    @field_validator("extra_resources", "replica_resources", mode="before")
    @classmethod
    def _extra_resources(cls, v: Any) -> Any:
        names = comma_list(v, "resource names")
        for name in names:
            problem = extended_resource_problem(name)
            if problem:
                raise ValueError(problem)
        return names

    @field_validator("max_body_bytes")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v

    @field_validator("certificate_check_s")
    @classmethod
    def _seconds(cls, v: float) -> float:
        if not 0 < v < float("inf"):
            raise ValueError(f"must be a positive number of seconds, got {v}")
        return v

    @model_validator(mode="after")
    def _https_only(self) -> WebhookConfig:
        if self.tls_cert is None or self.tls_key is None:
            raise ValueError("the webhook serves HTTPS only (the API server calls webhooks over HTTPS): give "
                             "--tls-cert and --tls-key")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"--metrics-port {self.metrics_port} is the HTTPS port: give it a port of its own")
        return self

    @property
    def keys(self) -> Keys:
        return Keys(self.annotation_prefix)


SETTINGS = SettingsLoader(WebhookConfig, "GPU_EXTENDER_WEBHOOK")
