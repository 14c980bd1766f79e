"""``fdsched check`` against the real host: the search finds FastDeploy's own defects from scratch with the host
alone, and none under a shipped profile (every one leaves the host fixes ``auto``).

Fixed seeds and case counts (a search that cannot fail is no search: the first test fails if the search stops
finding what it found when it was written). A longer run is one command: ``fdsched check --seed 1 --budget 3600``.
"""

from __future__ import annotations

from fdsched.core.settings import shipped_profiles
from fdsched.replay.check import HOST_ARM, PREFILL_RESERVE_DEFECT, SEATS_DEFECT, TWO_OWNERS_DEFECT, search


def _quiet_search(arms, seed, tmp_path, max_cases, budget=600, until=frozenset()):
    from fdsched.cmdline.quiet import host_output_to

    with host_output_to(tmp_path / "host.log"):
        return search(arms, seed, budget, out=tmp_path, max_cases=max_cases, report=lambda line: None, until=until)


def known_defects(has: dict) -> set:
    """The documented defects this line has (the probe reads each fix's "not needed" from the host's code): a block
    owned by two radix-tree nodes, preempted requests holding every seat, and a prefill node whose ratio reservation
    refuses chunks that need no block."""
    defects = set()
    if not has.get("one_node_per_block"):
        defects.add(TWO_OWNERS_DEFECT)
    if not has.get("preempted_seat_resume"):
        defects.add(SEATS_DEFECT)
    if has.get("ratio_reserve") and not has.get("prefill_node_reserve"):
        defects.add(PREFILL_RESERVE_DEFECT)
    return defects


def test_the_search_finds_the_hosts_defects_from_scratch(replay_host, tmp_path):
    """Seed 0 with FastDeploy alone, until every documented defect this line has is found (at most 400 cases): each
    is found, and nothing it finds is a shipped profile's."""
    expected = known_defects(replay_host.has)
    result = _quiet_search([HOST_ARM], seed=0, tmp_path=tmp_path, max_cases=400, until=frozenset(expected))
    known = {f.known for f in result["findings"]}
    assert expected <= known, ([f.line() for f in result["findings"]], result["cases"])
    for finding in result["findings"]:
        assert finding.arm == HOST_ARM and finding.path.is_file()
        assert len(finding.case.requests) <= 5  # shrunk


def test_no_shipped_profile_fails_a_case(replay_host, tmp_path):
    """Every shipped profile over the same drawn cases: no stall, no block-accounting error, no exception, no lost
    or short request (the host fixes are ``auto`` in each)."""
    from fdsched.replay.check_cli import _refused_profiles

    profiles = sorted(shipped_profiles())
    refused = _refused_profiles(profiles)  # a line that refuses a profile at load never runs it (support table)
    assert len(refused) < len(profiles)
    result = _quiet_search([p for p in profiles if p not in refused], seed=1, tmp_path=tmp_path, max_cases=25)
    assert result["cases"] == 25
    assert [f.line() for f in result["findings"]] == []
