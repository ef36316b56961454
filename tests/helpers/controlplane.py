"""A real Kubernetes control plane on 127.0.0.1 for tests and benchmarks that must meet the real components, not the
fake of tests/fakes/kubeapi: etcd (Debian's `etcd-server`), kube-apiserver, optionally kube-controller-manager, and
kube-schedulers started on demand with a given extender stanza.

The binaries come from the `shared` folder beside the clone, its kube/ (v1.36.2, xz; GPU_TOPOLOGY_KUBE_DIR names
another such folder): unpacked once into a cache under /var/tmp keyed by the SHA-256 of their SHA256SUMS, since
360 MB per run would cost seconds and disk. Certificates, the service-account key pair,
the token file and etcd's data live in a temporary directory the ControlPlane owns and removes. There is no kubelet:
`add_gpu_node` leaves a Node as the plugin and kubelet would (Ready, untainted, capacity and the plugin's
annotations). Every process is started in its own session and stopped by its pid (SIGTERM, then SIGKILL).

    if (why := skip_reason()): pytest.skip(why)
    with ControlPlane() as cp:
        cp.add_gpu_node("gpu-1", topology)
        sched = cp.start_scheduler(extenders=[...])
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from gputopo.contract import DEFAULT_KEYS
from gputopo.core import Topology, topology_to_json
from sim.ports import free_ports
from tests.helpers.paths import REPO
from tests.helpers.polling import scaled

# Beside the clone, never inside it (360 MB of binaries); nothing but this tier needs it, and it skips without.
KUBE_SHARED = Path(os.environ.get("GPU_TOPOLOGY_KUBE_DIR") or REPO.parent / "shared" / "kube")
CACHE_ROOT = Path("/var/tmp")
BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")
GPU = "nvidia.com/gpu"
ADMIN_TOKEN_USER = "gpu-topology-admin"
# The chart's second scheduler's ServiceAccount (release gpu-topology in namespace gpu-topology) as a user name:
# a static token user of this name is what RBAC subjects and admission policies of that account match.
EXTENDER_ACCOUNT = "system:serviceaccount:gpu-topology:gpu-topology-scheduler"
# What add_node registers a Node with besides GPUs; a node-group template must say the same
# (tests/helpers/autoscaler.py).
NODE_CAPACITY = {"cpu": "64", "memory": "512Gi", "pods": "250"}


def etcd_binary() -> str | None:
    """The etcd executable: $ETCD, else `etcd` on PATH (Debian's etcd-server puts it in /usr/bin)."""
    return os.environ.get("ETCD") or shutil.which("etcd")


def skip_reason() -> str | None:
    """Why a real control plane cannot run here (one line for pytest.skip or a benchmark's exit), or None."""
    if not (KUBE_SHARED / "SHA256SUMS").is_file() or not (KUBE_SHARED / "unpack.sh").is_file():
        return f"no Kubernetes binaries at {KUBE_SHARED} (the shared directory beside the clone)"
    if etcd_binary() is None:
        return "no etcd binary (apt-get install etcd-server, or set ETCD=/path/to/etcd)"
    if shutil.which("xz") is None:
        return "no xz to unpack the Kubernetes binaries"
    return None


def binaries_dir() -> Path:
    """Unpack the Kubernetes binaries once into /var/tmp/gpu-topology-kube-<sums hash>/ and return it; unpack.sh
    checks each binary's SHA-256 and skips one already there, so a second caller costs a few hashes."""
    sums = (KUBE_SHARED / "SHA256SUMS").read_bytes()
    dest = CACHE_ROOT / f"gpu-topology-kube-{hashlib.sha256(sums).hexdigest()[:16]}"
    if all((dest / b).is_file() for b in BINARIES) and (dest / ".complete").is_file():
        return dest
    done = subprocess.run(["bash", str(KUBE_SHARED / "unpack.sh"), str(dest)], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"unpacking {KUBE_SHARED} into {dest} failed: {done.stderr.strip()[-500:]}")
    (dest / ".complete").write_text(sums.decode())
    return dest


# -- certificates ------------------------------------------------------------------------------------------------


def _write_pki(d: Path) -> None:
    """CA, apiserver serving certificate (127.0.0.1, localhost, the kubernetes service names) and the
    service-account RSA key pair, as PEM files in `d`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-topology-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                      "kubernetes.default.svc.cluster.local")]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.96.0.1")]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    none = serialization.NoEncryption()
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    (d / "apiserver.crt").write_bytes(cert.public_bytes(pem))
    (d / "apiserver.key").write_bytes(key.private_bytes(pem, pkcs8, none))
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "sa.key").write_bytes(sa.private_bytes(pem, pkcs8, none))
    (d / "sa.pub").write_bytes(sa.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo))
    for p in ("apiserver.key", "sa.key"):
        (d / p).chmod(0o600)


# -- processes ---------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """A started binary: its Popen, its log file, and how to stop it by pid."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    _file: Any = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the pid, SIGKILL to its process group after `timeout`; safe to call twice."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._killpg()
                self.popen.wait(10)
        self._killpg()  # children a binary left behind in its own session (none expected)
        if self._file is not None:
            self._file.close()
            self._file = None

    def _killpg(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def start_process(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None) -> Proc:
    """Start `argv` in its own session (so its children die with it), output to `log`."""
    f = log.open("ab")
    popen = subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
    return Proc(name, popen, log, f)


def wait_until(what: str, check: Callable[[], object], timeout: float, proc: Proc | None = None,
               interval: float = 0.1) -> None:
    """Poll `check()` until truthy; RuntimeError naming `what` (and the process's log tail) on timeout or exit.
    `timeout` is the idle machine's, stretched by the load (tests.helpers.polling.scaled)."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        if proc is not None and not proc.running():
            raise RuntimeError(f"{proc.name} (pid {proc.pid}) exited with {proc.popen.returncode} before {what}:\n"
                               f"{proc.log_tail()}")
        if time.monotonic() > deadline:
            tail = f":\n{proc.log_tail()}" if proc is not None else ""
            raise RuntimeError(f"{what}: not after {timeout} s{tail}")
        time.sleep(interval)


# -- the control plane -------------------------------------------------------------------------------------------


@dataclass
class Scheduler:
    """A kube-scheduler started by ControlPlane.start_scheduler: its process, config, and metrics port."""

    proc: Proc
    config: Path
    port: int

    @property
    def log(self) -> Path:
        return self.proc.log

    def metrics(self) -> str:
        """GET /metrics on the secure port (always-allowed path, anonymous, self-signed certificate)."""
        return httpx.get(f"https://127.0.0.1:{self.port}/metrics", verify=False, timeout=5).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, rest = head.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self) -> None:
        self.proc.stop()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in a Prometheus text exposition whose labels include `labels` (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


@dataclass
class ExtenderProcess:
    """A `gpu-extender serve` started by ControlPlane.start_extender: its process, API and metrics ports."""

    proc: Proc
    port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` on its metrics port whose labels include `labels` (0 when none)."""
        return metric_sum(httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text, name, **labels)

    def stop(self) -> None:
        self.proc.stop()


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager when `controller_manager`), on free 127.0.0.1 ports, in a
    temporary directory this object owns. Use as a context manager; `stop()` is safe to call twice."""

    def __init__(self, *, controller_manager: bool = False, workdir: Path | None = None,
                 keep_workdir: bool = False, start_timeout: float = 90.0) -> None:
        reason = skip_reason()
        if reason:
            raise RuntimeError(f"real control plane unavailable: {reason}")
        self.with_controller_manager = controller_manager
        self.start_timeout = start_timeout
        self._own_dir = workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix="gpu-cp-", dir="/tmp")) if workdir is None else workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep_workdir = keep_workdir
        self.bin = binaries_dir()
        self.procs: list[Proc] = []
        self.schedulers: list[Scheduler] = []
        self.token = hashlib.sha256(os.urandom(32)).hexdigest()
        self.etcd_port, self.etcd_peer, self.api_port = free_ports(3)
        self.url = f"https://127.0.0.1:{self.api_port}"
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self._client: httpx.Client | None = None

    # lifecycle
    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        pki = self.dir / "pki"
        pki.mkdir(exist_ok=True)
        _write_pki(pki)
        tokens = self.dir / "tokens.csv"
        tokens.write_text(f'{self.token},{ADMIN_TOKEN_USER},uid-admin,"system:masters"\n'
                          f"{self.token}-sched,system:kube-scheduler,uid-sched\n"
                          f"{self.token}-kcm,system:kube-controller-manager,uid-kcm\n"
                          f"{self.token}-ext,{EXTENDER_ACCOUNT},uid-ext\n")
        tokens.chmod(0o600)
        self.write_kubeconfig(self.kubeconfig, self.token)
        etcd = start_process("etcd", [
            str(etcd_binary()), "--name", "cp", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
            "--initial-cluster", f"cp=http://127.0.0.1:{self.etcd_peer}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-level", "warn", "--quota-backend-bytes", str(2 << 30),
        ], self.dir / "etcd.log")
        self.procs.append(etcd)
        wait_until("etcd healthy", lambda: httpx.get(f"http://127.0.0.1:{self.etcd_port}/health", timeout=2)
                   .status_code == 200, self.start_timeout, etcd)
        api = start_process("kube-apiserver", [
            str(self.bin / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.api_port}",
            f"--cert-dir={self.dir / 'pki'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={tokens}",
            "--authorization-mode=Node,RBAC", f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true", "--v=1",
        ], self.dir / "kube-apiserver.log")
        self.procs.append(api)
        wait_until("kube-apiserver /readyz", lambda: self.api().get("/readyz").status_code == 200,
                   self.start_timeout, api, 0.25)
        # The default namespace's ServiceAccount comes from the controller-manager; without it pods are refused.
        wait_until("namespace default", lambda: self.api().get("/api/v1/namespaces/default").status_code == 200,
                   30, api)
        if self.with_controller_manager:
            self.start_controller_manager()
        else:
            self.ensure_service_account("default")

    def start_controller_manager(self) -> Proc:
        kc = self.write_kubeconfig(self.dir / "kcm.kubeconfig", f"{self.token}-kcm")
        (port,) = free_ports(1)
        pki = self.dir / "pki"
        kcm = start_process("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--controllers=*,-nodelifecycle", "--leader-elect=false",
            # each controller as its own ServiceAccount with its bootstrap role, as kubeadm runs it: the
            # controller-manager's own role does not cover them (the resource claim controller's creates, say)
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            f"--cert-dir={self.dir / 'kcm-certs'}", "--v=1",
        ], self.dir / "kube-controller-manager.log")
        self.procs.append(kcm)
        wait_until("kube-controller-manager /healthz", lambda: httpx.get(
            f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).status_code == 200, self.start_timeout, kcm)
        return kcm

    def stop(self) -> None:
        """Stop every scheduler and component this object started, newest first, by pid; remove the directory."""
        if self._client is not None:
            self._client.close()
            self._client = None
        errors: list[str] = []
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception as e:  # keep stopping the rest; report after
                errors.append(f"{proc.name} pid {proc.pid}: {e}")
        self.procs.clear()
        self.schedulers.clear()
        if self._own_dir and not self.keep_workdir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError("stopping the control plane: " + "; ".join(errors))

    # clients
    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """A kubeconfig for this apiserver (CA-verified), with `token` (the admin's by default)."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "cp",
            "clusters": [{"name": "cp", "cluster": {"server": self.url,
                                                   "certificate-authority": str(self.dir / "pki" / "ca.crt")}}],
            "users": [{"name": "u", "user": {"token": token or self.token}}],
            "contexts": [{"name": "cp", "context": {"cluster": "cp", "user": "u"}}],
        }))
        path.chmod(0o600)
        return path

    def api(self) -> httpx.Client:
        """An httpx client for the apiserver as the admin (system:masters); shared, not thread-safe to close."""
        if self._client is None:
            self._client = self.new_client()
        return self._client

    def new_client(self, timeout: float = 30.0) -> httpx.Client:
        """A fresh admin client (one per thread: watches block)."""
        return httpx.Client(base_url=self.url, verify=ssl.create_default_context(cafile=self.dir / "pki" / "ca.crt"),
                            timeout=timeout,
                            headers={"Authorization": f"Bearer {self.token}"})

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                ok: Sequence[int] = (200, 201, 202), **params: Any) -> Any:
        """One API call; RuntimeError with the apiserver's message unless the status is in `ok`."""
        r = self.api().request(method, path, json=body if content_type == "application/json" else None,
                               content=None if content_type == "application/json" else _json(body),
                               headers={"Content-Type": content_type}, params=params or None)
        if r.status_code not in ok:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else None

    def patch(self, path: str, body: Any, kind: str = "merge") -> Any:
        ctype = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind]
        return self.request("PATCH", path, body, content_type=ctype)

    # objects
    def ensure_namespace(self, name: str) -> None:
        """Create namespace `name` if missing, and its `default` ServiceAccount (the ServiceAccount admission plugin
        refuses pods without one; a controller-manager makes it too, but maybe only after the first pod)."""
        self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}}, ok=(201, 409))
        self.ensure_service_account(name)

    def ensure_service_account(self, namespace: str, name: str = "default") -> None:
        self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}},
                     ok=(201, 409))

    def add_node(self, name: str, *, labels: Mapping[str, str] | None = None,
                 annotations: Mapping[str, str] | None = None, extended: Mapping[str, str] | None = None,
                 cpu: str = NODE_CAPACITY["cpu"], memory: str = NODE_CAPACITY["memory"],
                 pods: str = NODE_CAPACITY["pods"]) -> dict[str, Any]:
        """Create a Node as a kubelet leaves it once up: hostname label, capacity = allocatable (cpu, memory, pods and
        `extended`), a Ready condition, and none of the not-ready taint the apiserver's admission adds on create."""
        meta: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                         **(labels or {})}}
        if annotations:
            meta["annotations"] = dict(annotations)
        self.request("POST", "/api/v1/nodes", {"metadata": meta, "spec": {}})
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        resources = {"cpu": cpu, "memory": memory, "pods": pods, **(extended or {})}
        self.patch(f"/api/v1/nodes/{name}/status", {"status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.36.2", "architecture": "amd64", "operatingSystem": "linux"}}},
            kind="strategic")
        return self.patch(f"/api/v1/nodes/{name}", {"spec": {"taints": None}})  # type: ignore[no-any-return]

    def add_gpu_node(self, name: str, topology: Topology, *, used: Sequence[str] = (),
                     labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A GPU Node as the plugin and kubelet leave it: nvidia.com/gpu = the topology's size, and the plugin's
        topology and state annotations (gputopo.contract keys; `used` GPU ids marked used, generation 1)."""
        import json

        keys = DEFAULT_KEYS
        state = json.dumps({"v": 1, "gen": 1, "used": sorted(used), "unhealthy": []})
        return self.add_node(name, labels=labels, extended={GPU: str(topology.size)},
                             annotations={keys.topology: topology_to_json(topology), keys.state: state})

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create a rendered object of one of KIND_PATHS' kinds (409: it is there already)."""
        prefix, plural, namespaced = KIND_PATHS[obj["kind"]]
        ns = obj["metadata"].get("namespace")
        path = f"{prefix}/namespaces/{ns}/{plural}" if namespaced else f"{prefix}/{plural}"
        return self.request("POST", path, dict(obj), ok=(200, 201, 409))  # type: ignore[no-any-return]

    def list_items(self, path: str, **params: Any) -> list[dict[str, Any]]:
        return list(self.request("GET", path, **params).get("items") or [])

    # schedulers
    def start_scheduler(self, extenders: Sequence[Mapping[str, Any]] = (), *, qps: float = 50, burst: int = 100,
                        name: str = "kube-scheduler", verbosity: int = 2,
                        extra_config: Mapping[str, Any] | None = None) -> Scheduler:
        """A kube-scheduler (no leader election) with `extenders` as its KubeSchedulerConfiguration stanza and
        client qps/burst, authenticated as system:kube-scheduler (the real RBAC). /metrics is readable without
        credentials on its secure port (--authorization-always-allow-paths). Ready when /healthz answers."""
        kc = self.write_kubeconfig(self.dir / f"{name}.kubeconfig", f"{self.token}-sched")
        (port,) = free_ports(1)
        config: dict[str, Any] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(kc), "qps": qps, "burst": burst},
            "leaderElection": {"leaderElect": False},
            "profiles": [{"schedulerName": "default-scheduler", "percentageOfNodesToScore": 100}],
            **({"extenders": [dict(e) for e in extenders]} if extenders else {}),
            **(extra_config or {}),
        }
        path = self.dir / f"{name}-config.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = start_process(name, [
            str(self.bin / "kube-scheduler"), f"--config={path}", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--authentication-tolerate-lookup-failure=true",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            f"--cert-dir={self.dir / (name + '-certs')}", f"--v={verbosity}",
        ], self.dir / f"{name}.log")
        self.procs.append(proc)
        sched = Scheduler(proc, path, port)
        wait_until(f"{name} /healthz", lambda: httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False,
                                                         timeout=2).status_code == 200, self.start_timeout, proc)
        self.schedulers.append(sched)
        return sched

    def extender_kubeconfig(self) -> Path:
        """A kubeconfig of EXTENDER_ACCOUNT, the user name of the chart's second-scheduler ServiceAccount (a static
        token here): what the chart's RBAC and pod-patch policy grant, once the test has applied them."""
        return self.write_kubeconfig(self.dir / "extender-account.kubeconfig", f"{self.token}-ext")

    def start_extender(self, *, name: str = "gpu-extender", extra: Sequence[str] = (),
                       env: Mapping[str, str] | None = None, kubeconfig: Path | None = None) -> ExtenderProcess:
        """`gpu-extender serve` from this checkout against this apiserver as the admin (or as `kubeconfig` says),
        plain HTTP on free 127.0.0.1 ports, no leader election, reservations held 600 s (nothing expires during a
        test); `extra` flags appended. Ready once /readyz answers 200 (every watch listed). Stopped
        with the control plane."""
        port, mport = free_ports(2)
        proc = start_process(name, [
            sys.executable, "-m", "extender.cli", "serve", "--kubeconfig", str(kubeconfig or self.kubeconfig),
            "--port", str(port),
            "--metrics-port", str(mport), "--metrics-host", "127.0.0.1", "--reservation-timeout", "600",
            "--log-level", "info", *extra,
        ], self.dir / f"{name}.log", env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=REPO)
        self.procs.append(proc)
        wait_until(f"{name} /readyz", lambda: httpx.get(f"http://127.0.0.1:{mport}/readyz", timeout=2)
                   .status_code == 200, self.start_timeout, proc, 0.2)
        return ExtenderProcess(proc, port, mport)

    def stop_scheduler(self, sched: Scheduler) -> None:
        sched.stop()
        if sched.proc in self.procs:
            self.procs.remove(sched.proc)
        if sched in self.schedulers:
            self.schedulers.remove(sched)


def serving_certificate(d: Path, name: str = "gpu-topology-webhook") -> tuple[Path, Path, Path]:
    """A CA and a serving certificate for 127.0.0.1 / localhost signed by it, as PEM files in `d`:
    (ca.crt, tls.crt, tls.key). What an admission webhook on the host needs: kube-apiserver calls webhooks over HTTPS
    only, trusting the configuration's caBundle."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name}-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = (d / "ca.crt", d / "tls.crt", d / "tls.key")
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    paths[2].chmod(0o600)
    return paths


def start_webhook(cp: ControlPlane, hook: Mapping[str, Any], *extra: str, name: str = "gpu-topology-webhook"
                  ) -> Proc:
    """`gpu-extender webhook` (this tree's code) on 127.0.0.1 with a certificate of its own, and a
    MutatingWebhookConfiguration of `hook` (one entry of a rendered configuration's `webhooks`: rules, selectors,
    matchConditions as deployed) whose clientConfig is pointed at it. Returns once the API server calls it: a
    dry-run pod asking one nvidia.com/gpu comes back with a schedulerName set."""
    import base64
    import sys

    ca, cert, key = serving_certificate(cp.dir / name)
    port, metrics = free_ports(2)
    proc = start_process(name, [
        sys.executable, "-m", "extender.cli", "webhook", "--host", "127.0.0.1", "--port", str(port),
        "--tls-cert", str(cert), "--tls-key", str(key), "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1",
        *extra], cp.dir / f"{name}.log", env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO)
    cp.procs.append(proc)
    wait_until(f"{name} /healthz", lambda: httpx.get(f"http://127.0.0.1:{metrics}/healthz", timeout=2)
               .status_code == 200, 60, proc, 0.2)
    entry = {**hook, "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate",
                                      "caBundle": base64.b64encode(ca.read_bytes()).decode()}}
    cp.request("POST", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
               {"metadata": {"name": name}, "webhooks": [entry]})
    probe = {"metadata": {"generateName": "webhook-probe-"}, "spec": {"containers": [{
        "name": "c", "image": "registry.invalid/none:0", "resources": {"limits": {GPU: "1"}}}]}}

    def answered() -> bool:
        cp.ensure_namespace("default")
        got = cp.request("POST", "/api/v1/namespaces/default/pods", probe, dryRun="All")
        return got["spec"].get("schedulerName") not in (None, "", "default-scheduler")

    wait_until(f"kube-apiserver calling {name}", answered, 30, proc, 0.25)
    return proc


def extender_stanza(url: str, *, weight: int = 5, http_timeout: str = "5s") -> dict[str, Any]:
    """The chart's extender entry (deploy/helm/gpu-topology/templates/scheduler-config.yaml), plain HTTP at `url`."""
    return {"urlPrefix": url, "filterVerb": "filter", "prioritizeVerb": "prioritize", "bindVerb": "bind",
            "preemptVerb": "preempt", "weight": weight, "enableHTTPS": False, "nodeCacheCapable": True,
            "httpTimeout": http_timeout, "ignorable": False,
            "managedResources": [{"name": GPU, "ignoredByScheduler": False}]}


def _json(body: Any) -> bytes:
    import json

    return json.dumps(body).encode()


CLUSTER_SCOPED = ("/api/v1/nodes", "/apis/resource.k8s.io/v1/resourceslices", "/apis/resource.k8s.io/v1/deviceclasses",
                  "/apis/scheduling.k8s.io/v1/priorityclasses",
                  "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
                  "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
                  "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
                  "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                  "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings")
# Where objects of a kind are created (ControlPlane.create): (API path prefix, plural, namespaced).
KIND_PATHS = {
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": ("/apis/admissionregistration.k8s.io/v1",
                                         "validatingadmissionpolicybindings", False),
}


@contextlib.contextmanager
def tidied(cp: ControlPlane) -> Iterator[ControlPlane]:
    """A control plane shared by several test modules, handed to one and left as it found it: the namespaces,
    Nodes, ResourceSlices, DeviceClasses, PriorityClasses, webhook configurations, admission policies, ClusterRoles
    and ClusterRoleBindings made meanwhile are deleted (the
    pods first, at once: no kubelet would ever confirm a graceful deletion), and every process started meanwhile
    (kube-schedulers, extenders, webhooks) is stopped. CRDs stay: an operator's kinds are installed once per
    cluster."""
    def names(path: str) -> set[str]:
        return {o["metadata"]["name"] for o in cp.list_items(path)}

    before = {path: names(path) for path in (*CLUSTER_SCOPED, "/api/v1/namespaces")}
    schedulers, procs = list(cp.schedulers), list(cp.procs)
    try:
        yield cp
    finally:
        for sched in [s for s in cp.schedulers if s not in schedulers]:
            cp.stop_scheduler(sched)
        for proc in [p for p in cp.procs if p not in procs]:
            proc.stop()
            cp.procs.remove(proc)
        for ns in sorted(names("/api/v1/namespaces") - before["/api/v1/namespaces"]):
            cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods", ok=(200, 404), gracePeriodSeconds=0)
            cp.request("DELETE", f"/api/v1/namespaces/{ns}", ok=(200, 202, 404))
        for path in CLUSTER_SCOPED:
            for name in sorted(names(path) - before[path]):
                cp.request("DELETE", f"{path}/{name}", ok=(200, 202, 404))
