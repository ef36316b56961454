# syntax=docker/dockerfile:1
# One image for both halves: the device plugin (`gpuplugin run`, a DaemonSet on GPU nodes) and the scheduler
# extender (`gpu-extender serve`, a sidecar of the second scheduler or its own HTTPS Deployment). Both run the same
# Python package on the same locked dependencies, so a second image would only double the pushes and pulls. The pod
# spec picks the binary (`command:`); the plugin's pod also sets NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES,
# which the image leaves unset so that the NVIDIA runtime never hands GPUs to an extender pod.
#
# Build from the repository root (scripts/build_image.sh does this, then runs both binaries in the image):
#   docker build -t <registry>/gpu-topology:0.1.0 \
#     --build-arg SOURCE_URL="$(python3 deploy/image/source_url.py)" .
# Behind a proxy that re-signs TLS, hand pip the CA bundle that trusts it (never stored in a layer):
#     --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt
# and a private index, as a secret when the URL holds credentials, else as a build argument:
#     --secret id=pip_index_url,src=./index-url.txt      or      --build-arg PIP_INDEX_URL=https://mirror/simple
#
# Base image: pinned by tag. Pin it by digest too in your registry mirror / CI
# (python:3.11-slim-bookworm@sha256:...); the digest could not be looked up where this file was written.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment holding the locked runtime closure and this project, pruned --------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_NO_CACHE_DIR=1
# Build stage only (its history never reaches the runtime image); no credentials here, use the secret for those.
ARG PIP_INDEX_URL
WORKDIR /src
RUN python -m venv --without-pip /opt/gpu-topology
# The lock first: its layer (the slow download) is reused while only our sources change.
COPY deploy/image/pip.sh deploy/image/pip.sh
COPY deploy/requirements-runtime.txt deploy/requirements-runtime.txt
RUN --mount=type=secret,id=ca_bundle,required=false \
    --mount=type=secret,id=pip_index_url,required=false \
    sh deploy/image/pip.sh --python /opt/gpu-topology/bin/python install --no-deps \
       --requirement deploy/requirements-runtime.txt
COPY pyproject.toml README.md LICENSE ./
# The OCI source label must name this project's repository: pyproject.toml's [project.urls] Source is the one place
# it is written, and the build stops here when the argument is missing or differs.
COPY deploy/image/source_url.py deploy/image/source_url.py
ARG SOURCE_URL
RUN python deploy/image/source_url.py --check "${SOURCE_URL}"
COPY gputopo gputopo
COPY gpuplugin gpuplugin
COPY extender extender
COPY sim sim
COPY deploy/image/prune.py deploy/image/prune.py
# --no-deps: the dependencies are the lock installed above, never a fresh resolution. The build backend
# (setuptools, from the index) is the only thing pip fetches here.
RUN --mount=type=secret,id=ca_bundle,required=false \
    --mount=type=secret,id=pip_index_url,required=false \
    sh deploy/image/pip.sh --python /opt/gpu-topology/bin/python install --no-deps . \
    && python deploy/image/prune.py /opt/gpu-topology

# ---- runtime: the Python runtime and that environment, nothing else ----------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
# VERSION only labels the image; the installed version is whatever the build stage built.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE_URL
LABEL org.opencontainers.image.title="gpu-topology" \
      org.opencontainers.image.description="Topology-aware GPU device plugin and kube-scheduler extender (NVLink/NVSwitch/PCIe aware)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/gpu-topology/bin:$PATH
COPY --from=build /opt/gpu-topology /opt/gpu-topology
# Nothing installs at run time: the base image's pip, setuptools and wheel go (CVE surface).
RUN pip uninstall --yes --root-user-action=ignore pip setuptools wheel \
    && useradd --system --no-log-init --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin gpu-topology
# Unprivileged by default: the extender and `gpuplugin topo | plan | record` need no more. The plugin's DaemonSet
# overrides it with runAsUser 0 (all capabilities dropped, no privilege escalation) because the plugin must create
# its socket in the host's root-owned /var/lib/kubelet/device-plugins (0755) and connect to the kubelet's root-owned
# sockets; fsGroup is not applied to hostPath volumes, so a fixed non-root uid cannot be granted that access without
# changing the host directory's permissions or adding CAP_DAC_OVERRIDE (worse than uid 0 with no capabilities).
# See deploy/README.md, "Security".
USER 10001:10001
# No HEALTHCHECK: Kubernetes ignores it; the pods' probes call /healthz and /readyz. Plugin metrics 8080, extender 8888.
EXPOSE 8080 8888
CMD ["gpuplugin", "--help"]
