"""Watches the device plugin directory and wakes the lifecycle thread when one of the names it cares about changes
(kubelet.sock, our socket). An event only wakes: it carries no decision, because events come late, in bursts, and
are missed while their reader is busy; the lifecycle reads the directory itself. No work runs on watchdog's thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

log = structlog.get_logger(__name__)


class _Handler(FileSystemEventHandler):
    def __init__(self, watch: DirectoryWatch) -> None:
        self._watch = watch

    def on_any_event(self, event: FileSystemEvent) -> None:
        try:
            names = {os.path.basename(os.fsdecode(event.src_path))}
            dest = getattr(event, "dest_path", "")
            if dest:
                names.add(os.path.basename(os.fsdecode(dest)))
            if names & self._watch.names:
                self._watch.on_change()
        except Exception:  # an exception here would end watchdog's thread and every later event with it
            log.exception("plugin.kubelet.watch_failed", path=str(event.src_path))


class DirectoryWatch:
    """inotify watch (through watchdog) on the plugin directory, non-recursive: `on_change()` on any event that
    names one of `names`."""

    def __init__(self, directory: Path, names: Iterable[str], on_change: Callable[[], None]) -> None:
        self.directory = Path(directory)
        self.names = frozenset(names)
        self.on_change = on_change
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.schedule(_Handler(self), str(self.directory), recursive=False)

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)
