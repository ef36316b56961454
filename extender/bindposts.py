"""The Bindings' POSTs, made by a worker process of their own so that the serving process keeps its GIL.

Why (issue 24): kube-scheduler waits for filter and prioritize one pod at a time while up to ~300 binds of earlier
pods are out. Each POST through the kubernetes client costs about 0.9 ms of Python (its models, urllib3,
http.client), and the threads that made them took the GIL from the event loop exactly while filter and prioritize
were waiting for it. The bind verb still chooses and reserves in the serving process, under the node lock
(reservations keep one owner); only the POST of the Binding it decided on comes here, with its annotations.

- Framing: a 4-byte big-endian length and orjson, over two socket pairs (requests: non-blocking on our side,
  written by the event loop; results: read by this Worker's thread).
- Bounds: at most `max_in_flight` POSTs out (the caller waits for room); each waits at most `deadline_s` for its
  result, after which the apiserver may still apply it (ApiUnavailable, applied unknown: the reservation stays
  until the pod is seen bound or gone, or it times out).
- The worker makes its client from the parent's make_api_client arguments (sent in the first frame, never on its
  command line), posts from `threads` threads at a lower CPU priority than the serving process, and exits when
  its request stream ends.
- A worker that dies is seen by its result stream ending: the POSTs it held answer ApiUnavailable with applied
  unknown (it may have sent them), POSTs asked for until it is back answer ApiUnavailable unsent (the reservation is
  released and kube-scheduler retries the pod), and it is started again after gputopo.retry's backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing.context
import multiprocessing.process
import os
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import orjson
import structlog

from extender.forkserver import worker_context
from gputopo.kube.errors import ApiUnavailable, KubeApiError, KubeArgumentError, error_class_for, may_have_applied
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 20  # one Binding with its annotations is a few kB; a longer frame is a broken stream
WORKER_NICE = 0  # on a 2-core node the serving process gets the CPU first; binds are in kube-scheduler's background


class BindPostError(Exception):
    """The worker's stream broke (not the apiserver's answer): a frame that cannot be read."""


def frame(message: Mapping[str, Any]) -> bytes:
    data = orjson.dumps(message)
    return HEADER.pack(len(data)) + data


class FrameReader:
    """Messages from a blocking socket, many per recv: a thread that blocked on every frame would wait for the GIL
    twice per message, and waiting for it is most of what such a thread does."""

    CHUNK = 1 << 16

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def next(self) -> dict[str, Any] | None:
        """The next message, None at the end of the stream. Raises BindPostError on a broken frame."""
        while True:
            if len(self.buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self.buf)
                if size > MAX_FRAME:
                    raise BindPostError(f"frame of {size} bytes exceeds {MAX_FRAME}")
                end = HEADER.size + size
                if len(self.buf) >= end:
                    data = bytes(self.buf[HEADER.size:end])
                    del self.buf[:end]
                    message = orjson.loads(data)
                    if not isinstance(message, dict):
                        raise BindPostError("frame is not a JSON object")
                    return message
            chunk = self.sock.recv(self.CHUNK)
            if not chunk:
                if self.buf:
                    raise BindPostError("stream ended inside a frame")
                return None
            self.buf += chunk


def error_message(err: KubeApiError) -> dict[str, Any]:
    """A failed POST as the worker sends it back: enough to raise the same typed error in the parent."""
    return {"status": err.status, "reason": err.reason, "message": err.message, "body": err.body,
            "operation": err.operation, "applied": may_have_applied(err)}


def raise_error(result: Mapping[str, Any]) -> None:
    """Raise, in the parent, the error of a result the worker sent back (nothing for a success)."""
    if "argument" in result:
        raise KubeArgumentError(str(result["argument"]))
    err = result.get("error")
    if err is None:
        return
    status = int(err.get("status") or 0)
    body = err.get("body") if isinstance(err.get("body"), dict) else None
    e = error_class_for(status)(status, str(err.get("reason") or "Unknown"), str(err.get("message") or ""), body,
                                operation=str(err.get("operation") or ""))
    e.applied = bool(err.get("applied"))
    raise e


class _Channel:
    """One running worker: its process, our ends of the two socket pairs, and the POSTs it holds."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, requests: socket.socket,
                 results: socket.socket) -> None:
        self.proc = proc
        self.requests = requests
        self.results = results
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Any]]]] = {}
        self.send_lock: asyncio.Lock | None = None
        self.ready = False
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for sock in (self.requests, self.results):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _settle(fut: asyncio.Future[dict[str, Any]], result: dict[str, Any]) -> None:
    if not fut.done():
        fut.set_result(result)


class BindPosts(Worker):
    """The parent's side: `await post(...)` raises exactly what gputopo.kube.bind_pod would have raised."""

    def __init__(self, recipe: Mapping[str, Any], *, log_level: str = "warning", threads: int = 8,
                 max_in_flight: int = 1024, deadline_s: float | None = None,
                 backoff: Backoff | None = None, on_start: Callable[[], object] | None = None) -> None:
        super().__init__("extender-bind-posts", join_timeout_s=10.0)
        self.recipe = dict(recipe)
        self.log_level = log_level
        self.threads = threads
        self.max_in_flight = max_in_flight
        timeout = float(self.recipe.get("timeout_s") or 10.0)
        # urllib3 retries a failed connect 3 times within one call; past that no result is coming
        self.deadline_s = deadline_s if deadline_s is not None else 4 * timeout + 5.0
        self.backoff = backoff or Backoff(0.2, 5.0)
        self.starts = 0  # workers started so far (a restart counts one more)
        self._on_start = on_start
        self._channel: _Channel | None = None
        self._ids = itertools.count(1)
        self._room = anyio.CapacityLimiter(max_in_flight)
        self._changed = threading.Condition()

    # -- the event loop's side --------------------------------------------------------------------------------

    async def post(self, *, namespace: str, name: str, uid: str | None, node: str,
                   annotations: Mapping[str, str] | None = None) -> None:
        """POST the Binding through the worker; raises KubeApiError (typed) or KubeArgumentError."""
        async with self._room:  # the bound on POSTs out
            await self._post({"namespace": namespace, "name": name, "uid": uid, "node": node,
                              "annotations": dict(annotations or {})})

    async def _post(self, job: dict[str, Any]) -> None:
        operation = f"bind pod {job['namespace']}/{job['name']} to {job['node']}"
        channel = self._channel
        if channel is None or channel.closed:
            err = ApiUnavailable(0, "BindWorkerDown", "the bind worker process is being restarted",
                                 operation=operation)
            err.applied = False
            raise err
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        job_id = next(self._ids)
        channel.pending[job_id] = (loop, fut)
        try:
            result = await asyncio.wait_for(self._exchange(channel, job_id, job, fut, operation), self.deadline_s)
        except TimeoutError:
            err = ApiUnavailable(0, "BindWorkerTimeout", f"no result from the bind worker in {self.deadline_s:g} s",
                                 operation=operation)
            err.applied = True  # it may have been sent
            raise err from None
        finally:
            channel.pending.pop(job_id, None)
        raise_error(result)

    async def _exchange(self, channel: _Channel, job_id: int, job: dict[str, Any],
                        fut: asyncio.Future[dict[str, Any]], operation: str) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        if channel.send_lock is None:
            channel.send_lock = asyncio.Lock()
        try:
            async with channel.send_lock:  # frames of concurrent binds never interleave
                await loop.sock_sendall(channel.requests, frame({"id": job_id, **job}))
        except OSError as e:
            err = ApiUnavailable(0, "BindWorkerDown", f"the bind worker process cannot take it: {e}",
                                 operation=operation)
            err.applied = False
            raise err from None
        return await fut

    # -- the supervising thread -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """A worker is up and has its client (its API classes imported): a bind now is posted at once."""
        channel = self._channel
        return channel is not None and channel.ready and not channel.closed

    def wait_ready(self, timeout: float) -> bool:
        """True once a worker is ready (the extender waits for the first one before it serves)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self.ready:
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping:
                    return False
                self._changed.wait(left)
        return True

    @property
    def pid(self) -> int | None:
        channel = self._channel
        return channel.proc.pid if channel is not None and not channel.closed else None

    def loop(self) -> None:
        while not self.stopping:
            try:
                channel = self._spawn()
            except OSError as e:
                log.error("extender.bind_posts.start_failed", error=str(e))
                if self.pause(self.backoff.failed(), wakeable=False):
                    return
                continue
            with self._changed:
                self._channel = channel
                self._changed.notify_all()
            self.starts += 1
            if self._on_start is not None:
                self._on_start()
            served = self._serve(channel)
            self._down(channel)
            if self.stopping:
                return
            log.error("extender.bind_posts.worker_died", pid=channel.proc.pid, exit_code=channel.proc.exitcode,
                      posts_lost=served, hint="its POSTs answer ApiUnavailable; a new worker starts after a backoff")
            if self.pause(self.backoff.failed(), wakeable=False):
                return

    def abandon(self) -> None:
        """Kill the worker now, POSTs it holds unsent or not: after a lost leader election Lease another replica
        may already lead, and what this one queued must never be written later. Those POSTs answer BindWorkerDied
        (applied unknown), as after any death of the worker."""
        channel = self._channel
        if channel is not None and channel.proc.pid is not None:
            with contextlib.suppress(OSError, ValueError):
                channel.proc.kill()
            log.warning("extender.bind_posts.abandoned", pid=channel.proc.pid, posts_held=len(channel.pending))

    def interrupt(self) -> None:
        channel = self._channel
        if channel is not None:
            channel.close()

    def _spawn(self) -> _Channel:
        req_ours, req_theirs = socket.socketpair()
        res_ours, res_theirs = socket.socketpair()
        try:
            proc = worker_context().Process(target=worker_main, args=(req_theirs, res_theirs),
                                            name="gpu-extender-bind-posts", daemon=True)
            proc.start()
        except (OSError, RuntimeError):
            for s in (req_ours, req_theirs, res_ours, res_theirs):
                s.close()
            raise
        req_theirs.close()
        res_theirs.close()
        setup = {"client": self.recipe, "log_level": self.log_level, "threads": self.threads,
                 "max_in_flight": self.max_in_flight}
        req_ours.sendall(frame(setup))  # before the loop writes: a fresh socket buffer takes it whole
        req_ours.setblocking(False)
        log.info("extender.bind_posts.worker_started", pid=proc.pid, threads=self.threads)
        return _Channel(proc, req_ours, res_ours)

    def _serve(self, channel: _Channel) -> int:
        """Read results until the worker's stream ends; how many POSTs it still held then."""
        reader = FrameReader(channel.results)
        while True:
            try:
                message = reader.next()
            except (BindPostError, OSError, ValueError) as e:
                if not channel.closed:
                    log.error("extender.bind_posts.stream_broken", error=str(e))
                break
            if message is None:
                break
            if message.get("ready"):
                self.backoff.reset()  # a worker that came up: the next death starts the curve again
                with self._changed:
                    channel.ready = True
                    self._changed.notify_all()
                continue
            entry = channel.pending.get(message.get("id", -1))
            if entry is not None:
                loop, fut = entry
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it any more
                    loop.call_soon_threadsafe(_settle, fut, message)
        return len(channel.pending)

    def _down(self, channel: _Channel) -> None:
        """The worker is gone or going: reap it, and answer every POST it held (it may have sent them)."""
        with self._changed:
            self._channel = None
            self._changed.notify_all()
        channel.close()
        proc = channel.proc
        proc.join(2 if self.stopping else 5)  # it ends by itself once its request stream is closed
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
        lost = {"error": {"status": 0, "reason": "BindWorkerDied", "message": "the bind worker process ended with "
                          f"exit code {proc.exitcode} while it held this POST", "applied": True}}
        for loop, fut in list(channel.pending.values()):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, lost)


# -- the worker process ----------------------------------------------------------------------------------------------


def worker_main(requests: socket.socket, results: socket.socket) -> None:
    """Read the setup frame, make the client, then POST each Binding asked for from a few threads."""
    import kubernetes.client

    from gputopo.kube import bind_pod, make_api_client
    from gputopo.logs import configure_logging

    reader = FrameReader(requests)
    setup = reader.next()
    if setup is None:
        return
    configure_logging(str(setup.get("log_level") or "warning"), component="extender")
    # Its threads mostly wait on sockets and each wake-up waits for the GIL: at Python's default of 5 ms per switch
    # the reading thread fell seconds behind 300 binds in flight (the serving process uses the same setting).
    sys.setswitchinterval(float(setup.get("switch_interval_s") or 0.0005))
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)
    api = make_api_client(**setup["client"])
    # The client imports its API classes and models on first use (seconds on a busy node, the first binds waiting
    # behind that import lock): before the worker says it is ready.
    kubernetes.client.CoreV1Api(api)
    for model in ("V1Binding", "V1ObjectMeta", "V1ObjectReference"):
        getattr(kubernetes.client, model)
    jobs: queue.Queue[dict[str, Any] | None] = queue.Queue(int(setup.get("max_in_flight") or 1024))
    write_lock = threading.Lock()

    def answer(message: dict[str, Any]) -> None:
        with write_lock:
            results.sendall(frame(message))

    def poster() -> None:
        while (job := jobs.get()) is not None:
            out: dict[str, Any] = {"id": job["id"]}
            try:
                bind_pod(api, namespace=job["namespace"], name=job["name"], uid=job["uid"], node=job["node"],
                         annotations=job["annotations"])
            except KubeApiError as e:
                out["error"] = error_message(e)
            except KubeArgumentError as e:
                out["argument"] = str(e)
            except Exception as e:  # never lose an answer: the parent waits for it
                log.exception("extender.bind_posts.post_failed", pod=f"{job['namespace']}/{job['name']}")
                out["error"] = {"status": 0, "reason": type(e).__name__, "message": str(e), "applied": True}
            try:
                answer(out)
            except OSError:
                return  # the parent is gone

    threads = [threading.Thread(target=poster, name=f"bind-post-{i}", daemon=True)
               for i in range(int(setup.get("threads") or 8))]
    for t in threads:
        t.start()
    answer({"ready": True})
    try:
        while (job := reader.next()) is not None:
            jobs.put(job)  # bounded: the parent never has more than max_in_flight out
    except (BindPostError, OSError, ValueError) as e:
        log.error("extender.bind_posts.stream_broken", error=str(e))
    # The parent is gone or stopping: what is queued and not posted yet is dropped, never written later. A parent
    # that died may have lost its leader election Lease, and another replica may be planning on those GPUs now.
    dropped = 0
    with contextlib.suppress(queue.Empty):
        while True:
            jobs.get_nowait()
            dropped += 1
    if dropped:
        log.warning("extender.bind_posts.dropped", posts=dropped)
    for _ in threads:
        jobs.put(None)
    for t in threads:
        t.join(1.0)  # the parent is gone or stopping: nobody reads what is still being posted
