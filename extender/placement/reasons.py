"""The words of placement: why a node cannot take a pod, as kube-scheduler shows it to the user.

Filter's FailedNodes / FailedAndUnresolvableNodes and bind's errors quote these strings; they are kept in one place
so each reason reads the same wherever it surfaces, and so the policy's arithmetic stays free of formatting.

How kube-scheduler shows them (pkg/scheduler: findNodesThatPassExtenders, FitError.Error, handleSchedulingFailure):
each failed node's string becomes that node's status reason; the FailedScheduling event and the pod's PodScheduled
condition then say "0/N nodes are available: " followed by every distinct reason with the number of nodes that
gave it, sorted ("3 needs 4 GPUs, 2 free, 12 node(s) had untolerated taint ..."). The event's note is cut at 1024
bytes ("..." after); the condition's message is not cut at all. So a reason that names a node's GPUs makes as many
entries as there are nodes. A reason therefore comes in three grains (`Reason`): the text, which may name the
node's GPUs; its `summary`, with nothing particular to the node, so nodes in the same state read the same; and its
`category`, one line per kind of refusal and pod size. `coarsened` answers with the finest grain whose distinct
reasons, each counted once, fit in MAX_REASONS_CHARS.

Each reason is one line of at most MAX_REASON_CHARS. Templates are written to fit with their fields (`fit` elides the
longest field, a name or a quoted value, in its middle); a text still too long (a hostile annotation's parse error)
is elided in its middle (`elided`), never cut at its end, so no reason ends in a broken word. Counts agree with their
nouns (`plural`: "1 GPU", "1 other job").
"""

from __future__ import annotations

from collections.abc import Callable

from gputopo.core.bitset import bits

# The characters the distinct reasons of one filter answer may take before coarser grains are used: the extender's
# part of the event then leaves room in kube-scheduler's 1024-byte note for the "0/N nodes are available" head, the
# in-tree plugins' reasons and preemption's message. The categories (at most seven per pod) fit in it.
MAX_REASONS_CHARS = 600
MAX_REASON_CHARS = 200  # a reason quoting a hostile annotation's parse error stays one readable line
ELLIPSIS = "..."
_MIN_ELIDED = 2 * len(ELLIPSIS) + 2  # the least a text is elided to: a head, "...", a tail
_SNAP = 16  # how far an elision's ends move to fall between words


def elided(text: str, limit: int) -> str:
    """`text` on one line in at most `limit` characters (at least _MIN_ELIDED): whole, or its head and its tail
    around "...", the cut moved to a space when one is near. A reason so shortened keeps its beginning (what it is
    about) and its end (its conclusion, its closing parenthesis): it never ends cut in the middle of a word, as a
    head-only cut did ("... 1 other jobs of unknown size still growing, so it...")."""
    text = " ".join(text.split())
    limit = max(limit, _MIN_ELIDED)
    if len(text) <= limit:
        return text
    room = limit - len(ELLIPSIS)
    head, tail = text[:(room + 1) // 2], text[len(text) - room // 2:]
    cut = head.rfind(" ", len(head) - _SNAP)
    if cut > 0:
        head = head[:cut + 1]
    cut = tail.find(" ", 0, _SNAP)
    if cut >= 0:
        tail = tail[cut:]
    return head + ELLIPSIS + tail


def fit(template: str, limit: int, **fields: object) -> str:
    """`template.format(**fields)` in at most `limit` characters, its own words whole: when too long, the longest
    fields (names, quoted values, notes: what grows without bound) are elided (`elided`) to one common length, the
    largest that fits. The template must leave room for its fields at _MIN_ELIDED characters each; past that the
    whole text is elided."""
    values = {k: " ".join(str(v).split()) for k, v in fields.items()}
    text = template.format(**values)
    over = len(text) - limit
    if over > 0 and values:
        lengths = [len(v) for v in values.values()]
        low, high = _MIN_ELIDED, max(lengths)  # the largest cap that takes `over` characters off, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if sum(max(0, n - mid) for n in lengths) >= over else (low, mid - 1)
        cap = low
        values = {k: elided(v, cap) for k, v in values.items()}
        text = template.format(**values)
    return elided(text, limit)


class Worded(str):
    """A text made by `fit` that can be made again in fewer characters, its template's words kept: `within`."""

    _template: str
    _fields: dict[str, object]

    def __new__(cls, template: str, limit: int, **fields: object) -> Worded:
        self = super().__new__(cls, fit(template, limit, **fields))
        self._template, self._fields = template, fields
        return self

    def within(self, limit: int) -> str:
        return str(self) if len(self) <= limit else fit(self._template, limit, **self._fields)

    @property
    def least(self) -> int:
        """The fewest characters it can be worded in with its template's words whole (every field elided)."""
        return len(self._template.format(**{k: "x" * min(len(" ".join(str(v).split())), _MIN_ELIDED)
                                            for k, v in self._fields.items()}))


def plural(n: int, noun: str) -> str:
    """'1 worker', '3 workers', '0 workers'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Reason(str):
    """A refusal in three grains: itself (per node), `summary` (equal for nodes in equal states), `category`; each
    at most `limit` characters (`elided`). A reason every node gives alike (a job's: extender.jobs.reasons) may take
    more than MAX_REASON_CHARS: it is one entry of the event however many nodes give it."""

    summary: str
    category: str

    def __new__(cls, text: str, summary: str | None = None, category: str | None = None,
                limit: int = MAX_REASON_CHARS) -> Reason:
        self = super().__new__(cls, elided(text, limit))
        self.summary = elided(summary if summary is not None else getattr(text, "summary", text), limit)
        self.category = elided(category if category is not None else getattr(text, "category", self.summary), limit)
        return self


class Failed(Reason):
    """Filter reason of a node that cannot take the pod now; evicting pods there could change that."""


class Unresolvable(Reason):
    """Filter reason of a node that no preemption can make fit (FailedAndUnresolvableNodes)."""


UNKNOWN_NODE = Reason("unknown to the GPU extender (no such Node seen)")
NO_TOPOLOGY = Reason("publishes no GPU topology", category="publishes no usable GPU topology or state")
DOES_NOT_FIT = Reason("does not fit")


def node_problem(problem: str) -> Reason:
    """A node whose annotations cannot be used (the text quotes the parse error, different per node)."""
    return Reason(problem, category=NO_TOPOLOGY.category)


GRAINS = ("text", "summary", "category")  # a reason's words, finest first (the text is the Reason itself)


def finest_grain(total: Callable[[int], int]) -> int:
    """The index in GRAINS of the finest grain whose distinct reasons take at most MAX_REASONS_CHARS characters in
    all (`total(grain)`, asked finest first and only as far as needed), else the categories, whatever they take."""
    return next((g for g in range(len(GRAINS) - 1) if total(g) <= MAX_REASONS_CHARS), len(GRAINS) - 1)


def coarsened(verdicts: list[bool | str]) -> list[bool | str]:
    """The verdicts of one filter answer (True or a Reason per node), in the finest grain that fits (finest_grain).
    The grain is chosen on the distinct reasons and the nodes' list translated once by a C-level map: a getattr
    per node cost 0.7 ms of a 5,000-node filter."""
    distinct = set(verdicts)
    distinct.discard(True)

    def words(grain: int) -> dict[bool | str, bool | str]:
        return {r: getattr(r, GRAINS[grain], r) for r in distinct}

    def total(grain: int) -> int:
        return sum(map(len, distinct if grain == 0 else set(words(grain).values())))  # type: ignore[arg-type]

    grain = finest_grain(total)
    if grain == 0:
        return verdicts
    chosen = words(grain)
    chosen[True] = True
    return list(map(chosen.__getitem__, verdicts))


def gpu_list(mask: int) -> str:
    """GPU indices as ranges: 0-3,6."""
    idx = bits(mask)
    parts = []
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}" if j > i + 1 else f"{idx[i]},{idx[j]}")
        i = j + 1
    return ",".join(parts)


def _gbps(gbps: float) -> str:
    return f"{gbps:.1f} GB/s"


def _gpus(size: int) -> str:
    return f"{size} GPU{'s' if size != 1 else ''}"


def too_few_in_total(size: int, total: int) -> Reason:
    return Reason(f"needs {_gpus(size)}, node has {total} in total",
                  category=f"needs {_gpus(size)}, more than the node has")


def _fewer_free(size: int) -> str:
    return f"needs {_gpus(size)}, fewer free"


def too_few_free(size: int, free_count: int) -> Reason:
    return Reason(f"needs {_gpus(size)}, {free_count} free", category=_fewer_free(size))


def shortfall(used: int, unhealthy: int, reserved: int, free: int, size: int) -> Reason:
    """'needs 4 GPUs, 2 free: GPU 0,1 in use, GPU 5 unhealthy'."""
    parts = []
    if used:
        parts.append(f"GPU {gpu_list(used)} in use")
    bad = unhealthy & ~used
    if bad:
        parts.append(f"GPU {gpu_list(bad)} unhealthy")
    if reserved:
        parts.append(f"GPU {gpu_list(reserved)} reserved for pods being bound")
    head = f"needs {_gpus(size)}, {free.bit_count()} free"
    summary = head + (" (some unhealthy)" if bad else "")
    return Reason(head + (": " + ", ".join(parts) if parts else ""), summary, _fewer_free(size))


def _nvlink_category(size: int) -> str:
    return f"requires an NVLink ring of {size} GPUs (require-nvlink): none free"


def no_nvlink(fabric: str, size: int) -> Reason:
    return Reason(f"requires NVLink: this node's GPUs have no NVLink ({fabric})", category=_nvlink_category(size))


def no_nvlink_ring(size: int, best_empty_gbps: float) -> Reason:
    return Reason(f"requires an NVLink ring of {size} GPUs: none exists on this node "
                  f"(best {_gbps(best_empty_gbps)} even when empty)", category=_nvlink_category(size))


def nvlink_ring_taken(size: int, chosen: int, gbps: float) -> Reason:
    return Reason(f"requires an NVLink ring of {size} GPUs: the best free ones (GPU {gpu_list(chosen)}) "
                  f"reach {_gbps(gbps)} over PCIe",
                  f"requires an NVLink ring of {size} GPUs: the best free ones reach {_gbps(gbps)} over PCIe",
                  _nvlink_category(size))


def _slow_category(min_gbps: float, size: int) -> str:
    return f"requires {_gbps(min_gbps)} all-reduce over {size} GPUs (min-allreduce-gbps): not reached"


def too_slow_ever(min_gbps: float, size: int, best_empty_gbps: float) -> Reason:
    return Reason(f"requires {_gbps(min_gbps)} all-reduce over {size} GPUs: this node's best is "
                  f"{_gbps(best_empty_gbps)} even when empty", category=_slow_category(min_gbps, size))


def too_slow_now(min_gbps: float, size: int, gbps: float) -> Reason:
    return Reason(f"requires {_gbps(min_gbps)} all-reduce over {size} GPUs: the best free ones reach {_gbps(gbps)}",
                  category=_slow_category(min_gbps, size))


# -- replicas of shared GPUs (issue 22) ------------------------------------------------------------------------------


def _replicas(size: int) -> str:
    return f"{size} replica{'s' if size != 1 else ''}"


def _distinct(size: int) -> str:
    return f" on {size} distinct GPUs" if size > 1 else ""


def not_shared(resource: str) -> Reason:
    return Reason(f"shares no GPU as {resource}", category=f"shares no GPU as {resource}")


def one_replica_per_container(largest: int, resource: str) -> Reason:
    """`largest` is the most one container asks: Allocate is called per container, and the option refuses only a
    request for more than one (a pod of two containers asking one each is admitted)."""
    return Reason(f"a container asks for {_replicas(largest)} of {resource}; this node's sharing config refuses "
                  "more than one per container (failRequestsGreaterThanOne)",
                  category=f"a container asks for more than one replica of {resource}; the node's sharing config "
                           "refuses that (failRequestsGreaterThanOne)")


def too_few_shared(size: int, shared: int, resource: str) -> Reason:
    return Reason(f"needs {_replicas(size)} of {resource}{_distinct(size)}, node shares only {shared} "
                  f"GPU{'s' if shared != 1 else ''} that way",
                  category=f"needs {_replicas(size)} of {resource} on distinct GPUs, more than the node shares")


def too_few_free_replicas(size: int, free: int, full: int, unhealthy: int, resource: str) -> Reason:
    """'needs 2 replicas of nvidia.com/gpu.shared on 2 distinct GPUs, 1 GPU has a free one: GPU 0-2 full'."""
    parts = []
    if full:
        parts.append(f"GPU {gpu_list(full)} full")
    if unhealthy:
        parts.append(f"GPU {gpu_list(unhealthy)} unhealthy")
    head = (f"needs {_replicas(size)} of {resource}{_distinct(size)}, {free} GPU{'s' if free != 1 else ''} "
            "with a free one")
    return Reason(head + (": " + ", ".join(parts) if parts else ""), head,
                  f"needs {_replicas(size)} of {resource} on distinct GPUs, fewer with a free replica")

