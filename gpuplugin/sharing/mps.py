"""MPS: one control daemon per shared set, run and watched by the plugin, and what a container gets to use it.

NVIDIA runs the daemon from a second privileged DaemonSet and sets the limits only as daemon defaults; here the
plugin runs `nvidia-cuda-mps-control -d` itself (same image, same pod), one per shared resource, with its pipe and
log directories under the MPS root (a hostPath), and Allocate hands each container its pipe directory plus
per-client limits matching its replicas (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: a
client can lower, never raise, the daemon's defaults, which are set too).

The daemon forks into the background, so it is not our child to wait on: it is judged by state, every pass
(`probe`): the pipe directory, its control socket, the pid file the daemon writes there and whether that process
lives, and `get_server_list` over the pipe. What follows from the state:
- it answers: it is used as it is, also by a plugin that did not start it (a restart finds it on the hostPath and
  adopts it: no second daemon, its clients keep their server); the defaults are sent again, which only affects
  servers started later;
- silent, but the pid file names a live control daemon: it is starting or stuck; a second one would be refused,
  and killing it would end its clients' server, so its replicas are unhealthy and the plugin waits;
- silent and no live daemon (never started, crashed, killed): started again (backoff between tries).
Its replicas are unhealthy whenever it does not answer, and healthy once it answers again.

Who runs it: here (`--mps-daemons in-plugin`, the default), or the MPS control daemon set (`external`:
gpuplugin.sharing.keeper runs this same class there, and the plugin's copy only probes, `manage=False`).

Lifetime: the daemon is started in a session of its own (not in the plugin's process group, so a signal to the
plugin's group does not reach it), and stopping the plugin only stops watching it: pods holding MPS replicas keep
their server across a plugin restart. `quit` is sent only when a config removes or replaces the shared set (the
node waits for the pods holding its replicas first) or when asked (`quit()`; the uninstall path in the README).

The command and the clock are injected, so CI runs the whole loop against a small program that speaks the control
protocol; the real daemon is exercised on a GPU by bench.sharing and bench.mps_limits. Compute mode is left alone
(NVIDIA's daemon sets EXCLUSIVE_PROCESS; that is the operator's choice here, not a side effect of installing a
plugin).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpuplugin.deviceplugin.allocation import Mount
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

DEFAULT_MPS_ROOT = Path("/run/nvidia/mps")
DEFAULT_CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
COMMAND_TIMEOUT_S = 10.0
CONTROL_SOCKET = "control"  # in the pipe directory: the control daemon's unix socket
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory: written by the control daemon


class MpsError(RuntimeError):
    """The control daemon could not be started or did not answer."""


@dataclass(frozen=True)
class MpsGpu:
    uuid: str
    replicas: int
    memory_mib: int | None


def thread_percentage(replicas: int, held: int = 1) -> int:
    """The compute share of `held` replicas of a GPU cut in `replicas` (at least 1 percent)."""
    return max(1, min(100, (100 * held) // replicas))


def memory_limit_mib(gpu: MpsGpu, held: int = 1) -> int | None:
    return None if gpu.memory_mib is None else max(1, (gpu.memory_mib * held) // gpu.replicas)


@dataclass(frozen=True)
class MpsShare:
    """Where one shared set's daemon lives. The pipe directory is mounted at the same path in the container, so the
    environment names a path that exists on both sides."""

    resource: str
    root: Path
    gpus: tuple[MpsGpu, ...]
    # a container may hold several replicas of one GPU (failRequestsGreaterThanOne and distinctGpus both false)
    several_per_client: bool = False

    @property
    def directory(self) -> Path:
        return self.root / self.resource  # NVIDIA's layout: <root>/<resource>/{pipe,log}

    @property
    def pipe_dir(self) -> Path:
        return self.directory / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.directory / "log"

    @property
    def shm_dir(self) -> Path:
        return self.root / "shm"

    def daemon_env(self) -> dict[str, str]:
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir),
                "CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in self.gpus)}

    def client(self, held: Sequence[tuple[str, int]]) -> tuple[dict[str, str], tuple[Mount, ...]]:
        """Environment and mounts of a container holding `held` = (GPU uuid, replicas of it) in the order its
        CUDA sees them (ordinal 0 first)."""
        by_uuid = {g.uuid: g for g in self.gpus}
        threads = min(thread_percentage(by_uuid[u].replicas, n) for u, n in held)
        env = {PIPE_ENV: str(self.pipe_dir), THREADS_ENV: str(threads)}
        limits = [(k, memory_limit_mib(by_uuid[u], n)) for k, (u, n) in enumerate(held)]
        if all(m is not None for _, m in limits):
            env[MEMORY_ENV] = ",".join(f"{k}={m}M" for k, m in limits)
        mounts = (Mount(str(self.pipe_dir), str(self.pipe_dir)), Mount("/dev/shm", str(self.shm_dir)))
        return env, mounts

    def _most_held(self, gpu: MpsGpu) -> int:
        return gpu.replicas if self.several_per_client else 1

    def default_commands(self) -> list[str]:
        """The daemon-wide defaults: the most one container can be given. A client's environment can only lower
        them (measured on the H200: bench/results/mps_limits.md), so they are one replica's share where a
        container holds one replica of a GPU at most (a client without our environment still gets one share),
        and the whole GPU where it may hold all of them (then its environment is its only limit). The thread
        percentage is one for the whole daemon: the largest of its GPUs' shares."""
        most = max(thread_percentage(g.replicas, self._most_held(g)) for g in self.gpus)
        lines = [f"set_default_active_thread_percentage {most}"]
        for ordinal, gpu in enumerate(self.gpus):
            limit = memory_limit_mib(gpu, self._most_held(gpu))
            if limit is not None:
                lines.append(f"set_default_device_pinned_mem_limit {ordinal} {limit}M")
        return lines


Runner = Callable[[Sequence[str], str, dict[str, str], float], subprocess.CompletedProcess[str]]


def run_command(argv: Sequence[str], stdin: str, env: dict[str, str],
                timeout: float) -> subprocess.CompletedProcess[str]:
    """Output goes to files, not pipes: `-d` forks a daemon that may keep the inherited descriptors open, and a
    pipe would then never reach end-of-file."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run(list(argv), input=stdin, env={**os.environ, **env}, stdout=out, stderr=err, text=True,
                              timeout=timeout, check=False, start_new_session=True)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(done.args, done.returncode, out.read(64 * 1024), err.read(64 * 1024))


@dataclass(frozen=True)
class DaemonState:
    """What the hostPath says about one shared set's control daemon."""

    pipe_dir: bool
    socket: bool
    pid: int | None  # from the pid file
    alive: bool  # the pid file names a running control daemon
    servers: tuple[int, ...] | None  # get_server_list's answer; None: it did not answer

    @property
    def answers(self) -> bool:
        return self.servers is not None


def _is_control_daemon(pid: int, program: str) -> bool:
    """Whether `pid` runs `program` (a pid file on a hostPath outlives its process, and pids are reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(os.fsdecode(arg)).name == program for arg in cmdline[:4] if arg)


class MpsDaemon(Worker):
    """Keeps one shared set's control daemon answering; `on_health(bool)` hears every change of that."""

    def __init__(self, share: MpsShare, on_health: Callable[[bool], None], *,
                 command: Sequence[str] = (DEFAULT_CONTROL,), interval_s: float = 5.0,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, runner: Runner = run_command,
                 manage: bool = True) -> None:
        super().__init__(f"mps-{share.resource}", join_timeout_s=COMMAND_TIMEOUT_S * 2)
        self.share = share
        # False: another process runs the daemon (`gpuplugin mps-control`); this one only probes it for health and
        # never starts, configures or quits it
        self.manage = manage
        self.command = tuple(command)
        self._on_health = on_health
        self._interval = interval_s
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._clock = clock
        self._run = runner
        self.healthy: bool | None = None
        self.starts = 0
        self.adopted = False  # it answered before this runner started one
        self.state: DaemonState | None = None
        self._next_start = 0.0
        self._silent_logged = False

    # -- talking to the daemon ----------------------------------------------------------------------------------

    def send(self, *lines: str) -> str:
        """Send commands over the daemon's pipe (the client mode of the control program); raises MpsError."""
        try:
            done = self._run(self.command, "".join(f"{line}\n" for line in lines), self.share.daemon_env(),
                             COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"{self.command[0]}: {e}") from None
        if done.returncode != 0:
            raise MpsError(f"{self.command[0]} exited {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}")
        return done.stdout.strip()

    def answers(self) -> bool:
        return self.probe().answers

    def probe(self) -> DaemonState:
        pipe = self.share.pipe_dir
        try:
            pid: int | None = int((pipe / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            pid = None
        try:
            servers: tuple[int, ...] | None = tuple(int(w) for w in self.send("get_server_list").split())
        except (MpsError, ValueError):
            servers = None
        state = DaemonState(pipe.is_dir(), (pipe / CONTROL_SOCKET).exists(), pid,
                            pid is not None and _is_control_daemon(pid, Path(self.command[-1]).name), servers)
        self.state = state
        return state

    def start_daemon(self) -> None:
        for d in (self.share.pipe_dir, self.share.log_dir, self.share.shm_dir):
            d.mkdir(parents=True, exist_ok=True)
        try:
            done = self._run([*self.command, "-d"], "", self.share.daemon_env(), COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"cannot start {self.command[0]} -d: {e}") from None
        if done.returncode != 0:
            raise MpsError(f"{self.command[0]} -d exited {done.returncode}: {(done.stderr or '').strip()[:300]}")
        self.starts += 1

    def quit(self) -> None:
        """End the daemon and, once their clients are done, its servers (NVIDIA's `quit`): only when the set goes
        away or on uninstall, never on a plugin stop."""
        try:
            self.send("quit")
            log.info("plugin.mps.stopped", resource=self.share.resource)
        except MpsError as e:
            log.info("plugin.mps.stop_skipped", resource=self.share.resource, error=str(e))

    # -- the loop -------------------------------------------------------------------------------------------------

    def _set_health(self, ok: bool) -> None:
        if self.healthy is ok:
            return
        self.healthy = ok
        (log.info if ok else log.warning)("plugin.mps.health_changed", resource=self.share.resource,
                                          healthy=ok, pipe=str(self.share.pipe_dir))
        self._on_health(ok)

    def step(self) -> float:
        """One pass: ask; if silent, mark unhealthy and (backoff allowing) start it and apply the defaults.
        Returns the seconds until the next pass."""
        state = self.probe()
        if not self.manage:
            if not state.answers and not self._silent_logged:
                self._silent_logged = True
                log.warning("plugin.mps.waiting", resource=self.share.resource, pid=state.pid, alive=state.alive,
                            pipe=str(self.share.pipe_dir), action="replicas unhealthy until the MPS control "
                                                                  "daemon set's daemon answers")
            elif state.answers:
                self._silent_logged = False
            self._set_health(state.answers)
            return self._interval
        if state.answers:
            if self.starts == 0 and not self.adopted:
                self.adopted = True
                log.info("plugin.mps.adopted", resource=self.share.resource, pipe=str(self.share.pipe_dir),
                         pid=state.pid, servers=list(state.servers or ()))
                self.send(*self.share.default_commands())
            self._backoff.reset()
            self._silent_logged = False
            self._set_health(True)
            return self._interval
        self._set_health(False)
        if state.alive:
            if not self._silent_logged:
                self._silent_logged = True
                log.warning("plugin.mps.silent", resource=self.share.resource, pid=state.pid,
                            pipe=str(self.share.pipe_dir), action="waiting: a second daemon would be refused")
            return self._interval
        now = self._clock()
        if now < self._next_start:
            return min(self._interval, self._next_start - now)
        try:
            self.start_daemon()
            self.send(*self.share.default_commands())
        except MpsError as e:
            delay = self._backoff.failed()
            self._next_start = self._clock() + delay
            log.warning("plugin.mps.start_failed", resource=self.share.resource, error=str(e),
                        retry_in_s=round(delay, 2))
            return min(self._interval, delay)
        log.info("plugin.mps.started", resource=self.share.resource, pipe=str(self.share.pipe_dir),
                 gpus=[g.uuid for g in self.share.gpus], starts=self.starts)
        self._set_health(self.answers())
        return self._interval if self.healthy else self._backoff.failed()

    def loop(self) -> None:
        self.run_passes(self.step, retry_s=self._interval,
                        failed=lambda: log.exception("plugin.mps.pass_failed", resource=self.share.resource))

    def stop(self, timeout: float | None = None, *, retire: bool = False) -> None:
        """Stop watching. The daemon keeps running for the pods holding its replicas unless `retire` (the set is
        gone from the config)."""
        super().stop(timeout)
        if retire and self.manage:
            self.quit()
