"""Watches the device plugin directory for the two events that matter: kubelet.sock (re)created and our socket
deleted. It only reports; the lifecycle thread decides what to do, so no work runs on watchdog's thread."""

from __future__ import annotations

import os
from collections.abc import Callable
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
            self._dispatch(event)
        except Exception:  # an exception here would end watchdog's thread and every later event with it
            log.exception("plugin.kubelet.watch_failed", path=str(event.src_path))

    def _dispatch(self, event: FileSystemEvent) -> None:
        names = {os.path.basename(os.fsdecode(event.src_path))}
        dest = getattr(event, "dest_path", "")
        if dest:
            names.add(os.path.basename(os.fsdecode(dest)))
        w = self._watch
        if w.kubelet_name in names and event.event_type in ("created", "moved"):
            log.info("plugin.kubelet.socket_created", kind=event.event_type)
            w.on_kubelet_created()
        elif names & {w.kubelet_name, w.socket_name}:
            w.on_change()


class DirectoryWatch:
    """inotify watch (through watchdog) on the plugin directory, non-recursive."""

    def __init__(
        self,
        directory: Path,
        socket_name: str,
        on_kubelet_created: Callable[[], None],
        on_change: Callable[[], None],
        kubelet_name: str = "kubelet.sock",
    ) -> None:
        self.directory = Path(directory)
        self.socket_name = socket_name
        self.kubelet_name = kubelet_name
        self.on_kubelet_created = on_kubelet_created
        self.on_change = on_change
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.schedule(_Handler(self), str(self.directory), recursive=False)

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)
