"""A stand-in for a Kubernetes Service in front of the extender replicas, for a control plane with no kube-proxy:
a TCP proxy on 127.0.0.1 whose endpoints are the pods matching a label selector (the extender's leader label) that
are ready, the way the EndpointSlice controller and kube-proxy follow a Service's selector.

- Endpoints: every `interval` (0.2 s) the pods in `namespace` matching `selector` are listed; each names its local
  port in the annotation PORT_ANNOTATION (there is one IP here, so the pod's IP cannot tell replicas apart). A pod
  is ready when its port accepts a TCP connection: the chart's readinessProbe is a tcpSocket probe, and a kubelet
  marks a pod whose container died unready within about a second (PLEG), which the 0.2 s probe stands for.
- New connections go to a ready endpoint (round robin when several); with none, the client's connection is closed at
  once (a Service without endpoints rejects). The proxy never retries a request: it carries bytes, not HTTP.
- Existing connections to an endpoint that leaves the set are closed at once (`keep_connections=False`, the
  default): the client learns at once. kube-proxy does not do that: conntrack keeps an established flow to a pod
  that left the endpoints until it fails or times out, so a terminating replica still answers what it was asked;
  `keep_connections=True` (`--keep-connections`) behaves so. Say which wherever this proxy's figures are used.

`python -m tests.helpers.service_proxy --kubeconfig K --namespace NS --selector L --listen-port P` runs it alone
(its own process, so a benchmark's CPU does not share its GIL); `ServiceProxy(...).start()` runs it in a thread.
Each endpoint change is logged with a wall-clock timestamp, so a benchmark can tell when traffic moved.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import signal
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

PORT_ANNOTATION = "service-proxy.gpu-topology.io/port"
LEADER_SELECTOR = "gpu-topology.io/extender-role=leader"
log = logging.getLogger("service-proxy")


class ServiceProxy:
    """Forward connections on `listen_port` to the ready pods `selector` picks in `namespace` (see the module)."""

    def __init__(self, api_url: str, token: str, ca_file: str | None, namespace: str, listen_port: int,
                 selector: str = LEADER_SELECTOR, interval: float = 0.2, probe_timeout: float = 0.3,
                 keep_connections: bool = False) -> None:
        self.api_url, self.token, self.ca_file = api_url, token, ca_file
        self.namespace, self.selector, self.listen_port = namespace, selector, listen_port
        self.interval, self.probe_timeout = interval, probe_timeout
        self.keep_connections = keep_connections
        self.endpoints: tuple[tuple[str, int], ...] = ()  # (pod name, port), ready, sorted
        self.changes: list[tuple[float, tuple[str, ...]]] = []  # (time.time(), pod names) per change
        self.connections = 0
        self.rejected = 0
        self._conns: dict[tuple[str, int], set[asyncio.StreamWriter]] = {}
        self._rr = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- running -------------------------------------------------------------------------------------------------
    async def serve(self) -> None:
        """Run until stop(): the listener and the endpoint follower."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.listen_port)
        follower = asyncio.create_task(self._follow())
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            follower.cancel()
            server.close()
            for writers in self._conns.values():
                for w in list(writers):
                    w.transport.abort()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower
            await server.wait_closed()

    def start(self, timeout: float = 10.0) -> ServiceProxy:
        """Run in a daemon thread; returns once listening."""
        def run() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as e:  # surfaced by start() or stop()
                self._error = e
                self._ready.set()

        self._thread = threading.Thread(target=run, name="service-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"service proxy on port {self.listen_port} did not start: {self._error}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    # -- endpoints -----------------------------------------------------------------------------------------------
    async def _follow(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(base_url=self.api_url, headers=headers, timeout=5,
                                     verify=ssl.create_default_context(cafile=self.ca_file) if self.ca_file
                                     else False) as client:
            while True:
                started = time.monotonic()
                try:
                    r = await client.get(f"/api/v1/namespaces/{self.namespace}/pods",
                                         params={"labelSelector": self.selector})
                    r.raise_for_status()
                    candidates = []
                    for pod in r.json().get("items") or []:
                        meta = pod.get("metadata") or {}
                        port = (meta.get("annotations") or {}).get(PORT_ANNOTATION)
                        if port and str(port).isdigit() and not meta.get("deletionTimestamp"):
                            candidates.append((meta["name"], int(port)))
                    ready = await asyncio.gather(*(self._probe(p) for _, p in candidates))
                    self._set_endpoints(tuple(sorted(c for c, ok in zip(candidates, ready, strict=True) if ok)))
                except (httpx.HTTPError, ValueError) as e:  # apiserver briefly away: keep the last endpoints
                    log.warning("listing endpoints failed: %s", e)
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def _probe(self, port: int) -> bool:
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), self.probe_timeout)
        except (OSError, TimeoutError):
            return False
        w.transport.abort()
        return True

    def _set_endpoints(self, eps: tuple[tuple[str, int], ...]) -> None:
        if eps == self.endpoints:
            return
        gone = set(self.endpoints) - set(eps)
        self.endpoints = eps
        now = time.time()
        self.changes.append((now, tuple(n for n, _ in eps)))
        log.warning("endpoints at %.3f: %s", now, ", ".join(f"{n}:{p}" for n, p in eps) or "none")
        for ep in () if self.keep_connections else gone:
            for w in list(self._conns.pop(ep, ())):
                w.transport.abort()

    # -- connections ---------------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        eps = self.endpoints
        if not eps:
            self.rejected += 1
            writer.transport.abort()
            return
        ep = eps[next(self._rr) % len(eps)]
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", ep[1]), 2)
        except (OSError, TimeoutError):
            self.rejected += 1
            writer.transport.abort()
            return
        self.connections += 1
        conns = self._conns.setdefault(ep, set())
        conns.update((writer, up_writer))
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            conns.discard(writer)
            conns.discard(up_writer)
            writer.transport.abort()
            up_writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF or error, then half-close (the HTTP client may still read the other direction)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.transport.abort()


def _from_kubeconfig(path: Path) -> tuple[str, str, str | None]:
    """(server, token, CA file) of a kubeconfig's current context (token users only: what the harness writes)."""
    cfg: dict[str, Any] = yaml.safe_load(path.read_text())
    ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == cfg["current-context"])
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
    return cluster["server"], user["token"], cluster.get("certificate-authority")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--selector", default=LEADER_SELECTOR)
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--keep-connections", action="store_true",
                        help="keep established connections to an endpoint that left (conntrack), not close them")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(asctime)s %(message)s")
    server, token, ca = _from_kubeconfig(opts.kubeconfig)
    proxy = ServiceProxy(server, token, ca, opts.namespace, opts.listen_port, opts.selector, opts.interval,
                         keep_connections=opts.keep_connections)

    async def run() -> None:
        task = asyncio.create_task(proxy.serve())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: proxy._stop.set() if proxy._stop else None)
        await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
