"""`gpuplugin demo`: the whole product on one machine, no GPU and no cluster (see sim.demo)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("demo")
@click.option("--out", "out_dir", default="demo-output", show_default=True, type=click.Path(file_okay=False),
              help="Where the PNG chart goes.")
@click.option("--seed", default=7, show_default=True, help="Seed of the pod stream.")
@click.option("--pods", default=26, show_default=True, type=click.IntRange(1, 500), help="How many pods arrive.")
def command(out_dir: str, seed: int, pods: int) -> None:
    """Simulated GPU nodes with real plugin processes and kubelet simulators, the real extender on uvicorn, and a
    stream of pods scheduled through it: where each landed, and what topology-blind placement would have given."""
    from sim.demo import main

    raise SystemExit(main(Path(out_dir), seed, pods))
