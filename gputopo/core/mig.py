"""MIG in the pure core: profiles and their names, placements on the 8 memory slices, what can still be created on
a GPU, and NVIDIA's documented profile tables.

Why each rule (sources in docs/reference/gpu-sharing.md §2):
- A MIG GPU has 7 compute slices and 8 memory slices; a GPU instance (GI) occupies the memory slices
  [start, start + size) of its placement, and instances may not overlap (§2.4). Compute slices never run out
  before memory slices with NVIDIA's start positions, but the sum is checked too.
- Names are NVIDIA's (go-nvlib's rule, which the device plugin's resource names come from): `<g>g.<mem>gb`, with
  the memory in the name `round(ceil(8 * profile memory / GPU memory) / 8 * ceil(GPU memory in GiB))`, and an
  attribute for the profile variants: `+me` (1_SLICE_REV1, the media extensions), `+gfx`, `-me`, `+me.all`. A
  compute instance smaller than its GI is named `<c>c.<g>g.<mem>gb`.
- The mixed strategy advertises `nvidia.com/mig-<name>` with `+` written as `.`, and only devices whose compute
  instance takes its whole GI (C == G); the others (`1c.2g.20gb`) are not advertised (§2.1).
- At most `instance_count` instances of a profile per GPU, and one media-extension (`+me`) instance per GPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gputopo.core.errors import CoreError

MEMORY_SLICES = 8
COMPUTE_SLICES = 7
MIG_RESOURCE_PREFIX = "mig-"

# NVML GPU-instance profile indices (nvmlDeviceGetGpuInstanceProfileInfo's `profile` argument) and the attribute
# go-nvlib appends to the name of each variant. Index -> (compute slices, attribute).
GI_PROFILE_INDEX: dict[int, tuple[int, str]] = {
    0: (1, ""),  # 1_SLICE
    1: (2, ""),  # 2_SLICE
    2: (3, ""),  # 3_SLICE
    3: (4, ""),  # 4_SLICE
    4: (7, ""),  # 7_SLICE
    5: (8, ""),  # 8_SLICE
    6: (6, ""),  # 6_SLICE
    7: (1, "+me"),  # 1_SLICE_REV1: media extensions
    8: (2, ""),  # 2_SLICE_REV1
    9: (1, ""),  # 1_SLICE_REV2: twice the memory
    10: (1, "+gfx"),
    11: (2, "+gfx"),
    12: (4, "+gfx"),
    13: (1, "-me"),
    14: (2, "-me"),
    15: (1, "+me.all"),
    16: (2, "+me.all"),
    17: (3, "+gfx"),
}
_NAME = re.compile(
    r"^(?:(?P<c>[1-8])c\.)?(?P<g>[1-8])g\.(?P<mem>[1-9][0-9]{0,4})gb(?P<attr>(?:[+-][a-z]+(?:\.[a-z]+)?)?)$"
)


class MigError(CoreError):
    """A MIG profile, placement or request is malformed or impossible (the message names it)."""


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """Memory slices [start, start + size) of one GPU."""

    start: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.start < 0 or self.start + self.size > MEMORY_SLICES:
            raise MigError(f"placement {{{self.start}}}:{self.size} is not within the {MEMORY_SLICES} memory slices")

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def mask(self) -> int:
        """The slices as bits (slice k = bit k)."""
        return ((1 << self.size) - 1) << self.start

    def overlaps(self, other: Placement) -> bool:
        return bool(self.mask & other.mask)

    def __str__(self) -> str:
        return f"{{{self.start}}}:{self.size}"


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GI profile of one GPU model: `name` ("1g.18gb+me"), NVML's profile `id` (19, 20, 15 ...), compute slices,
    memory slices (the placement size), the most instances a GPU holds, and where NVML places it."""

    name: str
    id: int
    compute_slices: int
    memory_slices: int
    instance_count: int
    starts: tuple[int, ...]
    memory_mib: int = 0
    multiprocessors: int = 0

    def __post_init__(self) -> None:
        parsed = parse_profile_name(self.name)
        if parsed.compute_slices is not None:
            raise MigError(f"GI profile {self.name!r} names a compute instance size")
        if parsed.gi_slices != self.compute_slices:
            raise MigError(
                f"GI profile {self.name!r} has {self.compute_slices} compute slices; its name says otherwise"
            )
        if not 1 <= self.compute_slices <= MEMORY_SLICES or self.instance_count < 1:
            raise MigError(f"GI profile {self.name!r}: bad slice or instance count")
        for start in self.starts:
            Placement(start, self.memory_slices)  # raises for a start off the GPU

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me") or "+me." in self.name

    @property
    def resource_suffix(self) -> str:
        """`1g.18gb+me` -> `1g.18gb.me`: what follows `nvidia.com/mig-` under the mixed strategy."""
        return resource_suffix(self.name)

    def placements(self) -> tuple[Placement, ...]:
        return tuple(Placement(s, self.memory_slices) for s in self.starts)


@dataclass(frozen=True, slots=True)
class ProfileName:
    """A parsed MIG device name: `[<c>c.]<g>g.<mem>gb[<attribute>]`."""

    compute_slices: int | None  # the CI's slices when it is smaller than the GI, else None
    gi_slices: int
    memory_gb: int
    attribute: str

    @property
    def gi_name(self) -> str:
        return f"{self.gi_slices}g.{self.memory_gb}gb{self.attribute}"


def parse_profile_name(name: str) -> ProfileName:
    """Read a MIG profile or device name; MigError names what is wrong with it."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise MigError(f"{name!r} is not a MIG profile name like '1g.18gb', '1g.18gb+me' or '1c.2g.20gb'")
    c = int(m["c"]) if m["c"] else None
    g = int(m["g"])
    if c is not None and c >= g:
        raise MigError(f"{name!r}: a compute instance of {c} slices does not fit a {g}-slice GPU instance")
    return ProfileName(c, g, int(m["mem"]), m["attr"] or "")


def memory_gb_in_name(gpu_memory_bytes: int, profile_memory_mib: int) -> int:
    """The GB in a profile name, as go-nvlib computes it (getMigMemorySizeGB): the profile's share of the GPU's
    memory rounded up to eighths, times the GPU's memory in whole GiB rounded up, rounded half away from zero."""
    if gpu_memory_bytes <= 0 or profile_memory_mib <= 0:
        raise MigError(f"memory sizes must be positive (GPU {gpu_memory_bytes} B, profile {profile_memory_mib} MiB)")
    fraction = profile_memory_mib * 1024 * 1024 / gpu_memory_bytes
    fraction = math.ceil(fraction * 8) / 8
    total_gib = -(-gpu_memory_bytes // (1024**3))
    return math.floor(fraction * total_gib + 0.5)


def gi_profile_name(profile_index: int, gpu_memory_bytes: int, profile_memory_mib: int, compute_slices: int) -> str:
    """NVIDIA's name of a GI profile from what NVML says about it (the index it was asked by, its memory and slices)."""
    known = GI_PROFILE_INDEX.get(profile_index)
    attribute = known[1] if known else ""
    return f"{compute_slices}g.{memory_gb_in_name(gpu_memory_bytes, profile_memory_mib)}gb{attribute}"


def device_name(gi_name: str, ci_slices: int) -> str:
    """The name of a MIG device: the GI's name, prefixed with `<c>c.` when its compute instance is smaller."""
    parsed = parse_profile_name(gi_name)
    if ci_slices < 1 or ci_slices > parsed.gi_slices:
        raise MigError(f"a compute instance of {ci_slices} slices does not fit GI profile {gi_name!r}")
    return gi_name if ci_slices == parsed.gi_slices else f"{ci_slices}c.{gi_name}"


def advertised_by_mixed(name: str) -> bool:
    """Whether NVIDIA's mixed strategy advertises devices of this name: only when C == G (no `<c>c.` prefix)."""
    return parse_profile_name(name).compute_slices is None


def resource_suffix(name: str) -> str:
    """`1g.18gb+me` -> `1g.18gb.me` (NVIDIA writes `+` as `.` in resource names)."""
    parse_profile_name(name)
    return name.replace("+", ".")


def resource_for(name: str) -> str:
    """The mixed strategy's resource name (without the `nvidia.com/` domain): `mig-1g.18gb.me`."""
    if not advertised_by_mixed(name):
        raise MigError(f"{name!r}: NVIDIA's mixed strategy advertises no resource for a compute-instance sub-profile")
    return MIG_RESOURCE_PREFIX + resource_suffix(name)


def profile_for_resource(resource: str, profiles: Iterable[MigProfile]) -> MigProfile:
    """The profile a mixed-strategy resource (`mig-1g.18gb.me`, domain optional) asks for, among `profiles`;
    exact match, so `mig-1g.24gb` never matches `1g.24gb-me` (the anchoring fix of NVIDIA's v0.20.0)."""
    local = resource.rsplit("/", 1)[-1]
    if not local.startswith(MIG_RESOURCE_PREFIX):
        raise MigError(f"{resource!r} is not a MIG resource (expected 'mig-<profile>')")
    suffix = local[len(MIG_RESOURCE_PREFIX) :]
    known = list(profiles)
    for p in known:
        if p.resource_suffix == suffix:
            return p
    names = ", ".join(sorted(p.name for p in known)) or "none"
    raise MigError(f"{resource!r} names no MIG profile of this GPU model (profiles: {names})")


@dataclass(frozen=True, slots=True)
class ProfileTable:
    """NVIDIA's GI profiles of one GPU model."""

    model: str
    profiles: tuple[MigProfile, ...]

    def by_name(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise MigError(f"{self.model} has no MIG profile {name!r} (has {', '.join(p.name for p in self.profiles)})")

    def by_id(self, profile_id: int) -> MigProfile:
        for p in self.profiles:
            if p.id == profile_id:
                return p
        raise MigError(f"{self.model} has no MIG profile id {profile_id}")


def _table(
    model: str, mem: tuple[int, int, int, int, int], sms: tuple[int, ...], names: tuple[str, ...]
) -> ProfileTable:
    """The A100/H100/H200 geometry (same starts on every one; docs/reference/gpu-sharing.md §2.4). `names` in the
    order 1g, 1g+me, 1g double memory, 2g, 3g, 4g, 7g; `mem` the MiB of a 1-, 2-, 4-, 4- and 8-slice GI."""
    one, two, four, four_b, full = mem
    sm1, sm1d, sm2, sm3, sm4, sm7 = sms
    rows = (
        (names[0], 19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), one, sm1),
        (names[1], 20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), one, sm1),
        (names[2], 15, 1, 2, 4, (0, 2, 4, 6), two, sm1d),
        (names[3], 14, 2, 2, 3, (0, 2, 4), two, sm2),
        (names[4], 9, 3, 4, 2, (0, 4), four, sm3),
        (names[5], 5, 4, 4, 1, (0,), four_b, sm4),
        (names[6], 0, 7, 8, 1, (0,), full, sm7),
    )
    return ProfileTable(model, tuple(MigProfile(n, i, c, m, k, s, mb, sm) for n, i, c, m, k, s, mb, sm in rows))


# Names, instance counts and starts: NVIDIA's tables (§2.4). Memory MiB and SMs of H200: what NVML answered on the
# lent H200 (tests/fixtures/recordings/h200-mig-disabled-nvml.json); H100 is the same GH100 die with 80 GB. A100:
# 14 SMs per slice; memory MiB chosen to give NVIDIA's names by the rule above (not in the reference).
A100_40GB = _table(
    "NVIDIA A100-SXM4-40GB",
    (4864, 9984, 20096, 20096, 40320),
    (14, 14, 28, 42, 56, 98),
    ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
)
A100_80GB = _table(
    "NVIDIA A100-SXM4-80GB",
    (9728, 19968, 40192, 40192, 81152),
    (14, 14, 28, 42, 56, 98),
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
)
H100_80GB = _table(
    "NVIDIA H100 80GB HBM3",
    (9984, 20224, 40192, 40192, 80896),
    (16, 26, 32, 60, 64, 132),
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
)
H200_141GB = _table(
    "NVIDIA H200",
    (16384, 33280, 71424, 71424, 143360),
    (16, 26, 32, 60, 64, 132),
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
)
PROFILE_TABLES: tuple[ProfileTable, ...] = (A100_40GB, A100_80GB, H100_80GB, H200_141GB)


@dataclass(frozen=True, slots=True)
class ExistingInstance:
    """A GI on a GPU: which profile, where."""

    profile: MigProfile
    placement: Placement


def check_layout(instances: Sequence[ExistingInstance]) -> None:
    """MigError when the instances could not coexist on one GPU (overlap, too many of a profile, two +me, more
    than 7 compute slices, a placement NVML would not use for the profile)."""
    used = 0
    compute = 0
    for k, inst in enumerate(instances):
        p = inst.profile
        if inst.placement.size != p.memory_slices or inst.placement.start not in p.starts:
            raise MigError(f"{p.name} cannot sit at {inst.placement} (starts {list(p.starts)}, size {p.memory_slices})")
        if used & inst.placement.mask:
            raise MigError(f"instance {k} ({p.name} at {inst.placement}) overlaps another instance")
        used |= inst.placement.mask
        compute += p.compute_slices
    if compute > COMPUTE_SLICES:
        raise MigError(f"the instances take {compute} compute slices; a GPU has {COMPUTE_SLICES}")
    for p in {i.profile for i in instances}:
        n = sum(1 for i in instances if i.profile == p)
        if n > p.instance_count:
            raise MigError(f"{n} instances of {p.name}; a GPU holds at most {p.instance_count}")
    if sum(1 for i in instances if i.profile.media_extensions) > 1:
        raise MigError("more than one media-extension (+me) instance on one GPU")


def possible_placements(profile: MigProfile, instances: Sequence[ExistingInstance]) -> tuple[Placement, ...]:
    """Where `profile` could still be created on a GPU holding `instances` (which must form a valid layout)."""
    check_layout(instances)
    if sum(1 for i in instances if i.profile == profile) >= profile.instance_count:
        return ()
    if profile.media_extensions and any(i.profile.media_extensions for i in instances):
        return ()
    if sum(i.profile.compute_slices for i in instances) + profile.compute_slices > COMPUTE_SLICES:
        return ()
    used = 0
    for i in instances:
        used |= i.placement.mask
    return tuple(pl for pl in profile.placements() if not pl.mask & used)


def free_slices(instances: Sequence[ExistingInstance]) -> int:
    used = 0
    for i in instances:
        used |= i.placement.mask
    return MEMORY_SLICES - bin(used).count("1")
