"""Registration with the kubelet: one RegisterRequest over <plugin dir>/kubelet.sock, in two steps nobody waits on.

Inside Register the kubelet dials our socket (blocking, up to 10 s) and calls GetDevicePluginOptions before it
answers, so our server must be serving at that moment, and a Register sent while our socket is gone holds the
kubelet for those 10 s. An `Attempt` therefore first connects to kubelet.sock and stops there; the lifecycle sends
Register only after it has looked at the directory again (the kubelet.sock it connected to is still the current
one, our socket is still ours). Both steps report through callbacks (connectivity, the call's completion) that only
wake the lifecycle's thread, which never blocks in either: a socket deleted meanwhile is seen and served again.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from gpuplugin.deviceplugin.errors import RegistrationError
from gpuplugin.deviceplugin.servicer import plugin_options
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
# The kubelet's own dial-back allows 10 s; leave room for its GetDevicePluginOptions call. Long, but nothing waits
# on it: the lifecycle keeps watching the directory while a Register is out.
DEFAULT_TIMEOUT_S = 15.0
_CONNECTIVITY_TICK_S = 0.2  # grpc/_channel.py, _poll_connectivity
_RELEASE_TIMEOUT_S = 10.0  # the poller ends within a tick once it runs; this bounds a starved one


class Step(enum.Enum):
    CONNECTING = "connecting"  # to kubelet.sock
    CONNECTED = "connected"  # Register not sent yet: the lifecycle re-checks the directory first
    SENT = "sent"  # Register in flight
    DONE = "done"  # the kubelet accepted
    FAILED = "failed"  # see `error`
    CLOSED = "closed"  # abandoned by the lifecycle


class Attempt:
    """One registration with the kubelet behind kubelet.sock at the time of connecting. Thread-safe; `on_change`
    is called (from gRPC's threads) whenever `step` moves, and must only wake someone."""

    def __init__(self, registrar: Registrar, on_change: Callable[[], None]) -> None:
        self._registrar = registrar
        self._on_change = on_change
        self._lock = threading.Lock()
        self._step = Step.CONNECTING
        self.error: RegistrationError | None = None
        self._future: grpc.Future | None = None
        # A connection of its own: gRPC otherwise shares one per target across channels, and a new kubelet.sock
        # would wait out the backoff of an earlier attempt's failed connection to the dead one.
        self._channel = grpc.insecure_channel(f"unix:{registrar.kubelet_socket}",
                                              options=[("grpc.use_local_subchannel_pool", 1)])
        self._channel.subscribe(self._on_connectivity, try_to_connect=True)

    @property
    def step(self) -> Step:
        return self._step

    def _move(self, step: Step, error: RegistrationError | None = None, *, only_from: tuple[Step, ...]) -> None:
        with self._lock:
            if self._step not in only_from:
                return
            self._step, self.error = step, error
        self._on_change()

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            self._move(Step.CONNECTED, only_from=(Step.CONNECTING,))
        elif state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            # Nobody listens (no kubelet, or a dead one's socket): fail now rather than wait out gRPC's backoff.
            self._move(Step.FAILED, RegistrationError(f"cannot connect to the kubelet at "
                                                      f"{self._registrar.kubelet_socket}", "UNAVAILABLE"),
                       only_from=(Step.CONNECTING,))

    def send(self) -> None:
        """Send Register on the connection made (only from CONNECTED; otherwise nothing happens)."""
        with self._lock:
            if self._step is not Step.CONNECTED:
                return
            self._step = Step.SENT
            stub = pb_grpc.RegistrationStub(self._channel)
            self._future = stub.Register.future(self._registrar.request(), timeout=self._registrar.timeout)
        self._future.add_done_callback(self._on_answer)

    def _on_answer(self, future: grpc.Future) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self._move(Step.DONE, only_from=(Step.SENT,))
            log.info("plugin.registration.done", resource=self._registrar.resource_name,
                     endpoint=self._registrar.endpoint)
            return
        assert isinstance(error, grpc.RpcError)
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        code = error.code().name if isinstance(error, grpc.Call) else None
        self._move(Step.FAILED, RegistrationError(
            f"kubelet at {self._registrar.kubelet_socket} refused registration: {details}", code),
            only_from=(Step.SENT,))

    def close(self) -> None:
        """Abandon the attempt (a Register in flight is cancelled) and free its channel. Safe to call twice."""
        with self._lock:
            if self._step is Step.CLOSED:
                return
            self._step = Step.CLOSED
            future = self._future
        if future is not None:
            future.cancel()
        # gRPC watches a subscribed channel in 0.2 s ticks, and closing the channel inside a tick makes the watching
        # thread die with a traceback: close once it has let go, on a thread of its own (not the lifecycle's).
        self._channel.unsubscribe(self._on_connectivity)
        threading.Thread(target=self._release, name="deviceplugin-registration-close", daemon=True).start()

    def _release(self) -> None:
        """Close the channel once gRPC's connectivity poller has stopped watching it. A fixed wait of a tick and
        a half bets on the scheduler: on a node whose cores are busy the poller may not have run by then, and
        closing under it kills it with a traceback. gRPC offers no event, so its own flag is read, bounded by
        `_RELEASE_TIMEOUT_S`."""
        state = getattr(self._channel, "_connectivity_state", None)
        deadline = time.monotonic() + _RELEASE_TIMEOUT_S
        while time.monotonic() < deadline:
            if state is None:  # another gRPC: fall back on waiting out the tick
                time.sleep(_CONNECTIVITY_TICK_S * 1.5)
                break
            with state.lock:
                if not state.polling:
                    break
            time.sleep(_CONNECTIVITY_TICK_S / 4)
        self._channel.close()


class Registrar:
    """What one endpoint registers (for one resource), and the attempts to do so."""

    def __init__(self, plugin_dir: Path, endpoint: str, resource_name: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.kubelet_socket = Path(plugin_dir) / KUBELET_SOCKET
        self.endpoint = endpoint
        self.resource_name = resource_name
        self.timeout = timeout

    def request(self) -> pb.RegisterRequest:
        return pb.RegisterRequest(
            version=API_VERSION, endpoint=self.endpoint, resource_name=self.resource_name, options=plugin_options()
        )

    def attempt(self, on_change: Callable[[], None]) -> Attempt:
        """A new attempt, connecting; the caller sends it once it has checked the directory again."""
        return Attempt(self, on_change)

    def register(self, timeout: float | None = None) -> None:
        """One attempt, waited for (tools and tests; the lifecycle drives attempts itself). Raises
        RegistrationError with the kubelet's message when it refuses or cannot be reached."""
        changed = threading.Event()
        attempt = self.attempt(changed.set)
        limit = self.timeout if timeout is None else timeout
        try:
            while True:
                changed.clear()  # before looking: a move from now on ends the wait below
                if attempt.step not in (Step.CONNECTING, Step.CONNECTED, Step.SENT):
                    break
                attempt.send()
                if not changed.wait(limit):
                    raise RegistrationError(f"no answer from the kubelet at {self.kubelet_socket} in {limit} s")
            if attempt.error is not None:
                raise attempt.error
        finally:
            attempt.close()
