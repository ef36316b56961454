"""The MPS control daemon set's loop (`gpuplugin mps-control`): keep one control daemon answering per MPS set the
plugin wants, from a pod of its own, so that a plugin pod restart or upgrade leaves the daemons and their clients
alone (the container runtime ends every process of a container when its main process exits: a daemon started by
the plugin died with the plugin's container).

Decided on state: every pass re-reads the desired-state file (gpuplugin.sharing.desired; a change to it wakes the
pass early through an inotify watch, the poll is the backstop) and makes the running set match:
- a set wanted and not kept here: an MpsDaemon is run for it (the same probe / start / adopt logic as in-plugin
  mode: a daemon already answering on its pipe directory, e.g. after this pod restarted, is adopted, never doubled;
  a dead one is started again with backoff);
- the same set with other GPUs or replicas, same (or lower) generation: a new MpsDaemon adopts the running daemon
  and sends the new defaults (the daemon is not restarted);
- a set gone from the file, or with a higher generation: its daemon quits (the plugin only takes a set out once no
  pod holds its replicas), and the new generation starts a fresh one. A lower generation (a plugin that found the
  file garbled at its start counts from 1 again) is not a replacement: the daemon stays, with the new defaults.
A file that cannot be read or is refused is logged once per distinct problem and the last good state is kept; no
file at all (the plugin has not written one yet) decides nothing. A daemon answering on a pipe directory under the
root that a good file no longer lists and this keeper does not run (the set was taken out while the keeper was
down) is quit too: under `--mps-daemons external` every daemon on the root is the keeper's. Stopping this process
leaves every daemon running: a restarted keeper adopts them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from gpuplugin.sharing.desired import DesiredSet, DesiredStateError, desired_path, read_desired
from gpuplugin.sharing.mps import DEFAULT_CONTROL, PID_FILE, MpsDaemon, MpsShare
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

MAX_ORPHAN_SCAN = 64  # pipe directories looked at per pass


class MpsKeeper(Worker):
    def __init__(self, root: Path, *, command: Sequence[str] = (DEFAULT_CONTROL,), poll_interval_s: float = 2.0,
                 daemon_interval_s: float = 2.0, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 on_health: Callable[[str, bool], None] | None = None) -> None:
        super().__init__("mps-keeper", join_timeout_s=30.0)
        self.root = root
        self.command = tuple(command)
        self._poll = poll_interval_s
        self._daemon_options = {"interval_s": daemon_interval_s, "backoff_initial_s": backoff_initial_s,
                                "backoff_max_s": backoff_max_s}
        self._on_health = on_health
        self.kept: dict[str, tuple[DesiredSet, MpsDaemon]] = {}
        self.last_good: dict[str, DesiredSet] | None = None
        self.problem: str | None = None  # the last refusal of the file, until a good one is read
        self.passes = 0
        self._orphans_seen: set[tuple[str, str]] = set()  # (resource, pid file text) already handled

    def _daemon(self, wanted: DesiredSet) -> MpsDaemon:
        resource = wanted.share.resource
        hook = self._on_health

        def health(ok: bool) -> None:
            if hook is not None:
                hook(resource, ok)

        return MpsDaemon(wanted.share, health, command=self.command, **self._daemon_options).start()

    def quit_orphans(self, wanted: dict[str, DesiredSet]) -> list[str]:
        """Quit the daemons on the root that neither the file nor this keeper has; each pid file looked at once."""
        quit = []
        for pid_file in itertools.islice(self.root.glob(f"*/*/pipe/{PID_FILE}"), MAX_ORPHAN_SCAN):
            resource = "/".join(pid_file.relative_to(self.root).parts[:2])
            if resource in wanted or resource in self.kept:
                continue
            try:
                key = (resource, pid_file.read_text()[:32])
            except OSError:
                continue
            if key in self._orphans_seen:
                continue
            self._orphans_seen.add(key)
            daemon = MpsDaemon(MpsShare(resource, self.root, ()), lambda ok: None, command=self.command)
            state = daemon.probe()
            if state.answers:
                daemon.quit()
                quit.append(resource)
                log.info("plugin.mps_set.orphan_quit", resource=resource, pid=state.pid,
                         reason="answering on the root, not in the desired-state file")
        return quit

    def read(self) -> dict[str, DesiredSet] | None:
        """What is wanted now: the file, else (refused, unreadable, gone) the last good state."""
        try:
            wanted = read_desired(self.root)
        except DesiredStateError as e:
            if str(e) != self.problem:
                self.problem = str(e)
                log.error("plugin.mps_desired.refused", error=str(e), path=str(e.path),
                          action="keeping the last good state", kept=sorted(self.last_good or ()))
            return self.last_good
        if wanted is None:
            if self.problem != "missing":
                self.problem = "missing"
                log.info("plugin.mps_desired.missing", path=str(desired_path(self.root)),
                         action="waiting for the plugin" if self.last_good is None else "keeping the last good state")
            return self.last_good
        if self.problem is not None:
            log.info("plugin.mps_desired.accepted", path=str(desired_path(self.root)), sets=sorted(wanted))
        self.problem = None
        self.last_good = wanted
        return wanted

    def step(self) -> float:
        self.passes += 1
        wanted = self.read()
        if wanted is None:
            return self._poll
        for name in list(self.kept):
            have, daemon = self.kept[name]
            want = wanted.get(name)
            if want == have:
                continue
            if want is None or want.generation > have.generation:
                del self.kept[name]
                daemon.stop(retire=True)
                if self._on_health is not None:
                    self._on_health(name, False)
                log.info("plugin.mps_set.retired", resource=name, generation=have.generation,
                         replaced=want is not None)
            else:  # new defaults for the same daemon: a new runner adopts it and sends them
                daemon.stop()
                self.kept[name] = (want, self._daemon(want))
                log.info("plugin.mps_set.updated", resource=name, generation=want.generation)
        for name, want in wanted.items():
            if name not in self.kept:
                self.kept[name] = (want, self._daemon(want))
                log.info("plugin.mps_set.kept", resource=name, generation=want.generation,
                         pipe=str(want.share.pipe_dir), gpus=[g.uuid for g in want.share.gpus])
        if self.problem is None:  # a good file says what is wanted: the rest on the root goes
            self.quit_orphans(wanted)
        return self._poll

    def loop(self) -> None:
        self.run_passes(self.step, retry_s=self._poll, failed=lambda: log.exception("plugin.mps_keeper.pass_failed"))

    def stop(self, timeout: float | None = None) -> None:
        """Stop keeping; the daemons run on for their clients (a restarted keeper adopts them)."""
        super().stop(timeout)
        for name in list(self.kept):
            _, daemon = self.kept.pop(name)
            daemon.stop()
