"""Where FakeDraKubeApi was imported from before tests/fakes/kubeapi/ became a package; new code imports it from
tests.fakes.kubeapi. Kept so branches written against the old path merge unchanged."""

from tests.fakes.kubeapi.dra import FakeDraKubeApi

__all__ = ["FakeDraKubeApi"]
