"""Where GetPreferredAllocation can take a ready-made plan from: the protocol a plan provider implements.

The scheduler extender decides, at bind time, which GPUs a pod should get on its node and writes that plan onto the
pod. The kubelet, when it later asks the plugin for a preference, does not say which pod it is admitting. A plan
source bridges the two: given the kubelet's question, it works out which pod is being admitted and returns that
pod's plan for the container being allocated (gpuplugin.plan_watch reads the kubelet's PodResources List for it).
Another pod's plan is never the answer: with shared GPUs it piles replicas onto GPUs already in use, and with whole
GPUs it leaves both pods' annotations wrong.

The plugin never trusts a plan: it uses it only if it lies inside `available_ids`, contains every id of
`must_include_ids` and has exactly `size` ids, none repeated. Anything else (including an exception from the
source) is logged and counted, and the plugin answers with its own allocator's choice instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class PlanSource(Protocol):
    """A provider of pending plans (implemented elsewhere, e.g. from pod annotations written by the extender)."""

    def pending_plan(
        self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int
    ) -> list[str] | None:
        """The device ids of a pending plan that fits this request, or None when no plan applies.

        Called on the gRPC thread answering the kubelet, so it must return quickly (no API calls inline: keep
        plans cached and answer from memory). Ids are the plugin's advertised device ids.
        """
        ...
