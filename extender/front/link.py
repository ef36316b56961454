"""The state process's side of the answering process (extender.front): start it on the API socket and keep one
running, stream the node states to it, run what it passes on through the full app, and apply what it tells.

The node states go as they change (NodeCache.on_state_change, from whichever thread changed them): names are
collected and sent in one message per event-loop turn, each with the node's state as it is when sent, so a burst
of changes to one node costs one entry and the copy always converges on the cache. A new answering process gets
every state first, and "ready" only once the cache is synced and everything it held then was sent.

Passed-on requests are bounded by the answering process's connection cap (one request per HTTP/1.1 connection at a
time). An answering process that exits while this one is not stopping is started again after `restart_delay_s`;
the listening socket stays open here meanwhile, so clients wait in its backlog rather than being refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import threading
from typing import Any

import structlog
from starlette.types import ASGIApp

from extender.front.channel import ChannelClosed, RelayedMetrics, frame, read_message
from extender.front.spawn import DEFAULT_COMMAND, hand_over, spawn, take_early
from extender.service import Extender

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 30.0
LEADING_POLL_S = 0.05  # how soon the answering process follows a change of leadership


class FrontLink:
    def __init__(self, ext: Extender, app: ASGIApp, listen: socket.socket, *, restart_delay_s: float = 1.0,
                 command: list[str] | None = None) -> None:
        self.ext = ext
        self.app = app
        self.listen = listen
        self.restart_delay_s = restart_delay_s
        self.command = command or DEFAULT_COMMAND
        self.starts = 0
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._sent_fingerprints: set[str] = set()
        self._sent_names: tuple[frozenset[str], frozenset[str]] | None = None
        self._calls: set[asyncio.Task[None]] = set()
        ext.cache.on_state_change.append(self._changed)

    # -- node states -------------------------------------------------------------------------------------------

    def _changed(self, name: str) -> None:
        """Any thread, under the cache's state lock: note the name, wake the loop once per batch."""
        with self._lock:
            self._dirty.add(name)
            if self._scheduled or self._loop is None or self._writer is None:
                return
            self._scheduled = True
        if threading.get_ident() == self._loop_thread:
            self._loop.call_soon(self._flush)  # a bind's reservation: no wake-up through the loop's self-pipe
        else:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            names, self._dirty, self._scheduled = self._dirty, set(), False
        # an answering process that is going (its end closed, its exit not seen yet) gets nothing more
        if names and self._writer is not None and not self._writer.is_closing():
            self._send_states(names)

    def _send_states(self, names: set[str] | list[str]) -> None:
        assert self._writer is not None
        cache = self.ext.cache
        states: dict[str, tuple[Any, ...] | None] = {}
        topologies = {}
        for name in names:
            st = cache.states.get(name)
            if st is None:
                states[name] = None
                continue
            states[name] = st.key
            fp = st.fingerprint
            if fp and fp not in self._sent_fingerprints:
                topo = cache.topologies.get(fp)
                if topo is not None:
                    topologies[fp] = topo
                    self._sent_fingerprints.add(fp)
        now = (cache.mig_names, cache.shared_names)
        mig = shared = None
        if self._sent_names is None or now != self._sent_names:
            mig, shared = now
            self._sent_names = now
        self._writer.write(frame(("states", states, topologies, mig, shared)))

    def _connected(self, writer: asyncio.StreamWriter) -> None:
        self._sent_fingerprints = set()
        self._sent_names = None
        with self._lock:
            self._writer = writer
            self._dirty = set()
            self._scheduled = False
        self._send_states(list(self.ext.cache.states))

    async def _ready_when_synced(self, writer: asyncio.StreamWriter) -> None:
        sync = self.ext.sync
        while sync is not None and not sync.synced:
            await asyncio.sleep(0.05)
        self._flush()  # every state the synced cache held goes before "ready"
        writer.write(frame(("ready",)))

    async def _follow_leading(self, writer: asyncio.StreamWriter) -> None:
        """Whether the answering process may answer: under leader election only while this replica holds the Lease
        (a standby's requests are all passed on here and answered 503); without election, once."""
        sent: bool | None = None
        while True:
            leading = self.ext.leading()
            if writer.is_closing():
                return
            if leading != sent:
                writer.write(frame(("leading", leading)))
                sent = leading
            if self.ext.leadership is None:
                return
            await asyncio.sleep(LEADING_POLL_S)

    # -- what the answering process sends ----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        try:
            while True:
                message = await read_message(reader)
                if message[0] == "call":
                    task = asyncio.create_task(self._call(writer, *message[1:4]))
                    self._calls.add(task)
                    task.add_done_callback(self._calls.discard)
                elif message[0] == "told":
                    self._told(message[1])
                else:
                    log.warning("extender.front.unknown_message", kind=message[0])
        except ChannelClosed as e:
            return str(e)

    def _told(self, ops: list[tuple[Any, ...]]) -> None:
        metrics = self.ext.metrics
        for op in ops:
            try:
                if op[0] == "recent":
                    self.ext.recent.remember(op[1])
                elif op[0] == "offer":
                    self.ext.explainer.remember(op[1], op[2])
                elif op[0] == "metric":
                    RelayedMetrics.apply_op(metrics, op)
            except Exception as e:
                log.warning("extender.front.bad_op", op=str(op[0]), error=f"{type(e).__name__}: {e}")

    async def _call(self, writer: asyncio.StreamWriter, call_id: int, plain: dict[str, Any], body: bytes) -> None:
        done = asyncio.Event()
        delivered = False
        status, headers, chunks = 500, [], []

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()  # as a real server: nothing more until the client goes
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers") or [])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        scope = {**plain, "asgi": {"version": "3.0", "spec_version": "2.3"}, "extensions": {}}
        try:
            await self.app(scope, receive, send)
            content = b"".join(chunks)
        except Exception:
            log.exception("extender.front.call_failed", path=plain.get("path"))
            status, headers = 500, [(b"content-type", b"application/json")]
            content = b'{"Error":"gpu-extender internal error"}'
        finally:
            done.set()
        try:
            reply = frame(("reply", call_id, status, headers, content))
        except ValueError as e:  # an answer above the channel's frame limit
            log.error("extender.front.reply_too_large", path=plain.get("path"), error=str(e))
            reply = frame(("reply", call_id, 500, [(b"content-type", b"application/json")],
                           b'{"Error":"gpu-extender: the answer is too large to pass on"}'))
        writer.write(reply)

    # -- the process -------------------------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Keep an answering process serving until `stopping`; then stop it (it finishes its requests, whose
        passed-on parts are still answered here) and return."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        while not stopping.is_set():
            early = take_early() if self.starts == 0 and self.command == DEFAULT_COMMAND else None
            proc, parent = early or spawn(self.command)
            self.starts += 1
            log.info("extender.front.started", pid=proc.pid, starts=self.starts, early=early is not None)
            hand_over(parent, self.listen)
            reader, writer = await asyncio.open_unix_connection(sock=parent)
            writer.write(frame(("config", self.ext.config)))
            self._connected(writer)
            leading = asyncio.create_task(self._follow_leading(writer))
            ready = asyncio.create_task(self._ready_when_synced(writer))
            serving = asyncio.create_task(self._serve(reader, writer))
            stop_wait = asyncio.create_task(stopping.wait())
            await asyncio.wait({serving, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.is_set():
                await self._stop(proc, serving)
            ready.cancel()
            leading.cancel()
            stop_wait.cancel()
            with self._lock:
                self._writer = None
            writer.close()
            code = await asyncio.to_thread(proc.wait)
            # its connections went with it, without the decrements the gauge counted on
            self.ext.metrics.http_connections.labels("api").set(0)
            if not stopping.is_set():
                log.error("extender.front.exited", pid=proc.pid, returncode=code, why=serving.result(),
                          restart_in_s=self.restart_delay_s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.restart_delay_s)

    async def _stop(self, proc: subprocess.Popen[bytes], serving: asyncio.Task[str]) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("extender.front.kill", pid=proc.pid, waited_s=STOP_TIMEOUT_S)
            proc.kill()
        serving.cancel()
        for task in list(self._calls):
            task.cancel()


def serve_state_process(ext: Extender, app: ASGIApp, listen: socket.socket, metrics_server: Any | None,
                        metrics_sock: socket.socket | None) -> int:
    """`gpu-extender serve` as the state process: the extender's watches and workers, the metrics listener where
    there is one, and an answering process on `listen`, until SIGTERM or SIGINT. Returns the exit code: 3 when the
    metrics listener failed (as serve_beside)."""
    import uvloop

    link = FrontLink(ext, app, listen)
    failed: list[BaseException] = []

    async def run() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        ext.start()
        companion = None
        if metrics_server is not None and metrics_sock is not None:
            async def run_companion() -> None:
                try:
                    await metrics_server.serve(sockets=[metrics_sock])
                except (SystemExit, Exception) as e:
                    failed.append(e)
                    stopping.set()

            companion = asyncio.create_task(run_companion())

        async def step_down() -> None:  # hand the Lease over at once, not after the answering process has ended
            await stopping.wait()
            if ext.leadership is not None:
                await asyncio.to_thread(ext.leadership.stop)

        stepping_down = asyncio.create_task(step_down())
        try:
            await link.run(stopping)
            await stepping_down
        finally:
            stepping_down.cancel()
            if companion is not None:
                metrics_server.should_exit = True
                await companion
            ext.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    if failed:
        log.error("extender.metrics.failed", error=str(failed[0]))
        return 3
    return 0
