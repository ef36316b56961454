"""`gpuplugin mps-control`: the MPS control daemon set's process (gpuplugin.sharing.keeper): one control daemon per
MPS set the plugin asks for in `<mps-root>/mps-desired.json`, run from a pod of its own so that a plugin pod restart
or upgrade leaves the daemons and their clients alone. The plugin runs with `--mps-daemons external` beside it.

Settings: the model below, loaded by gputopo.settings (flag > environment `GPUPLUGIN_MPS_CONTROL_<FLAG>` > YAML
`--config` > default). Exit codes: 0 after SIGTERM/SIGINT (the daemons keep running), 2 for invalid settings.
"""

from __future__ import annotations

import threading
from pathlib import Path

import click
import structlog
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuplugin.sharing.desired import DESIRED_FILE
from gpuplugin.sharing.mps import DEFAULT_CONTROL, DEFAULT_MPS_ROOT
from gputopo.logs import configure_logging
from gputopo.settings import LogLevel, Port, SettingsLoader
from gputopo.workers import stop_on_signals

log = structlog.get_logger("gpuplugin.mps_control")


class MpsControlSettings(BaseModel):
    """Validated settings. Field names are the flag names with '_' for '-'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mps_root: Path = Field(DEFAULT_MPS_ROOT, description="Host directory of the MPS pipe, log and shm directories "
                                                         "and of the plugin's desired-state file (the plugin's "
                                                         "--mps-root).")
    mps_control: str = Field(DEFAULT_CONTROL, description="The MPS control program run per MPS set.")
    poll_interval: float = Field(2.0, description="Seconds between re-reads of the desired-state file (a change "
                                                  "also wakes it at once).")
    probe_interval: float = Field(2.0, description="Seconds between probes of each control daemon.")
    metrics_port: Port = Field(8081, description="Port of /metrics and /healthz (200 while the loop runs); 0 "
                                                 "turns them off.")
    log_level: LogLevel = Field("info", description="Least level logged.")

    @field_validator("poll_interval", "probe_interval")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not 0 < v <= 3600:
            raise ValueError(f"{v} must be a number of seconds in (0, 3600]")
        return v


SETTINGS = SettingsLoader(MpsControlSettings, "GPUPLUGIN_MPS_CONTROL")


def run_keeper(settings: MpsControlSettings, stop: threading.Event) -> None:
    """Keep the daemons until `stop` is set; the daemons outlive it."""
    from prometheus_client import Gauge

    from gpuplugin.deviceplugin.watcher import DirectoryWatch
    from gpuplugin.metrics import PREFIX, MetricsServer
    from gpuplugin.sharing.keeper import MpsKeeper
    from gputopo.metrics import process_registry
    from gputopo.workers import Teardown

    settings.mps_root.mkdir(parents=True, exist_ok=True)
    registry = process_registry()
    answering = Gauge(f"{PREFIX}_mps_daemon_answering", "1 while the MPS set's control daemon answers on its pipe.",
                      ["resource"], registry=registry)
    with Teardown("gpuplugin mps-control") as teardown:
        keeper = MpsKeeper(settings.mps_root, command=(settings.mps_control,), poll_interval_s=settings.poll_interval,
                           daemon_interval_s=settings.probe_interval,
                           on_health=lambda resource, ok: answering.labels(resource).set(int(ok))).start()
        teardown.undo(keeper.stop)
        if settings.metrics_port:
            try:
                server = MetricsServer(registry, lambda: keeper.running, settings.metrics_port).start()
            except OSError as e:
                raise click.ClickException(f"cannot serve metrics on port {settings.metrics_port}: "
                                           f"{e.strerror or e}") from None
            teardown.undo(server.stop)
        watch = DirectoryWatch(settings.mps_root, {DESIRED_FILE}, keeper.wake)
        watch.start()
        teardown.undo(watch.stop)
        log.info("plugin.mps_keeper.started", root=str(settings.mps_root), control=settings.mps_control)
        stop.wait()
        log.info("plugin.mps_keeper.stopping", action="the daemons keep running for their clients")


@click.command("mps-control", epilog=SETTINGS.epilog)
@SETTINGS.command
def command(settings: MpsControlSettings) -> None:
    """Run the MPS control daemons the plugin's desired-state file asks for (the MPS control daemon set)."""
    configure_logging(settings.log_level)
    run_keeper(settings, stop_on_signals("gpuplugin mps-control"))
