"""The core's MIG model: names, resources, NVIDIA's tables, layouts and what can still be created."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from gputopo.core.mig import (
    A100_40GB,
    A100_80GB,
    H100_80GB,
    H200_141GB,
    PROFILE_TABLES,
    ExistingInstance,
    MigError,
    MigProfile,
    Placement,
    ProfileTable,
    advertised_by_mixed,
    check_layout,
    device_name,
    free_slices,
    gi_profile_name,
    memory_gb_in_name,
    parse_profile_name,
    possible_placements,
    profile_for_resource,
    resource_for,
)

# The GPUs' memory as NVML reports it: H200 from the real machine, the others as the synthetic recordings.
TOTALS = {A100_40GB.model: 40 * 2**30, A100_80GB.model: 80 * 2**30, H100_80GB.model: 85520809984,
          H200_141GB.model: 150754820096}
INDEX = {19: 0, 14: 1, 9: 2, 5: 3, 0: 4, 20: 7, 15: 9}


def inst(table: ProfileTable, name: str, start: int) -> ExistingInstance:
    p = table.by_name(name)
    return ExistingInstance(p, Placement(start, p.memory_slices))


@pytest.mark.parametrize("table", PROFILE_TABLES, ids=lambda t: t.model)
def test_each_table_names_follow_the_go_nvlib_rule_from_its_memory(table: ProfileTable) -> None:
    for p in table.profiles:
        assert gi_profile_name(INDEX[p.id], TOTALS[table.model], p.memory_mib, p.compute_slices) == p.name


def test_the_documented_names_per_model() -> None:
    assert [p.name for p in A100_80GB.profiles] == ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb",
                                                   "4g.40gb", "7g.80gb"]
    assert [p.name for p in H200_141GB.profiles] == ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb",
                                                    "4g.71gb", "7g.141gb"]
    assert A100_40GB.profiles[0].name == "1g.5gb"
    assert [(p.instance_count, p.starts) for p in H100_80GB.profiles] == [
        (7, (0, 1, 2, 3, 4, 5, 6)), (1, (0, 1, 2, 3, 4, 5, 6)), (4, (0, 2, 4, 6)), (3, (0, 2, 4)), (2, (0, 4)),
        (1, (0,)), (1, (0,))]


def test_go_nvlib_rounds_half_away_from_zero_not_to_even() -> None:
    # 3g.71gb on H200: 4/8 of 141 GiB = 70.5 -> 71 (Python's round() would give 70)
    assert memory_gb_in_name(150754820096, 71424) == 71
    with pytest.raises(MigError):
        memory_gb_in_name(0, 1)


def test_resource_names_write_plus_as_dot_and_only_for_whole_compute_instances() -> None:
    assert resource_for("1g.18gb+me") == "mig-1g.18gb.me"
    assert resource_for("7g.141gb") == "mig-7g.141gb"
    assert not advertised_by_mixed("1c.2g.20gb") and advertised_by_mixed("2g.20gb")
    with pytest.raises(MigError, match="sub-profile"):
        resource_for("1c.2g.20gb")
    assert device_name("2g.20gb", 1) == "1c.2g.20gb" and device_name("2g.20gb", 2) == "2g.20gb"
    with pytest.raises(MigError):
        device_name("2g.20gb", 3)


def test_a_resource_names_its_profile_exactly() -> None:
    assert profile_for_resource("nvidia.com/mig-1g.18gb.me", H200_141GB.profiles).name == "1g.18gb+me"
    assert profile_for_resource("mig-1g.18gb", H200_141GB.profiles).name == "1g.18gb"
    with pytest.raises(MigError, match="no MIG profile of this GPU model"):
        profile_for_resource("mig-1g.10gb", H200_141GB.profiles)
    with pytest.raises(MigError, match="not a MIG resource"):
        profile_for_resource("nvidia.com/gpu", H200_141GB.profiles)


@pytest.mark.parametrize("name", ["", "1g", "0g.5gb", "9g.5gb", "2c.2g.20gb", "1g.5gb+", "1g.5GB", "1g.05gb",
                                  "a1g.5gb", "1g.5gb+me+me", None])
def test_bad_profile_names_are_refused(name: str | None) -> None:
    with pytest.raises(MigError):
        parse_profile_name(name)  # type: ignore[arg-type]


def test_placements_stay_on_the_eight_memory_slices() -> None:
    assert str(Placement(4, 4)) == "{4}:4" and Placement(6, 2).mask == 0b11000000
    for start, size in ((7, 2), (-1, 1), (0, 0), (0, 9)):
        with pytest.raises(MigError):
            Placement(start, size)


def test_bad_layouts_are_refused_with_the_reason() -> None:
    t = H100_80GB
    with pytest.raises(MigError, match="overlaps"):
        check_layout([inst(t, "3g.40gb", 0), inst(t, "2g.20gb", 2)])
    with pytest.raises(MigError, match=r"\+me"):
        check_layout([ExistingInstance(t.by_name("1g.10gb+me"), Placement(0, 1)),
                      ExistingInstance(t.by_name("1g.10gb+me"), Placement(1, 1))])
    with pytest.raises(MigError, match="cannot sit"):
        check_layout([ExistingInstance(t.by_name("3g.40gb"), Placement(2, 4))])


def _brute_possible(profile: MigProfile, instances: list[ExistingInstance]) -> set[int]:
    out = set()
    for start in profile.starts:
        try:
            check_layout([*instances, ExistingInstance(profile, Placement(start, profile.memory_slices))])
        except MigError:
            continue
        out.add(start)
    return out


def _all_layouts(table: ProfileTable, limit: int = 4) -> Iterator[list[ExistingInstance]]:
    """Every valid layout of up to `limit` instances (exhaustive over profiles x starts)."""
    cells = [(p, s) for p in table.profiles for s in p.starts]
    for k in range(limit + 1):
        for combo in itertools.combinations(cells, k):
            layout = [ExistingInstance(p, Placement(s, p.memory_slices)) for p, s in combo]
            try:
                check_layout(layout)
            except MigError:
                continue
            yield layout


def test_possible_placements_agree_with_trying_each_start_on_every_layout() -> None:
    layouts = list(_all_layouts(H200_141GB))
    assert len(layouts) > 200
    for layout in layouts:
        for p in H200_141GB.profiles:
            got = {x.start for x in possible_placements(p, layout)}
            assert got == _brute_possible(p, layout), (p.name, layout)
        assert 0 <= free_slices(layout) <= 8


def test_4g_beside_3g_is_allowed_and_a_full_gpu_takes_nothing_more() -> None:
    t = H200_141GB
    assert [x.start for x in possible_placements(t.by_name("3g.71gb"), [inst(t, "4g.71gb", 0)])] == [4]
    full = [inst(t, "7g.141gb", 0)]
    assert all(possible_placements(p, full) == () for p in t.profiles)
