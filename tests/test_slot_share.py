"""Who gives up a slot when a stage has none left (node.slot_share): fair shares by source."""

from __future__ import annotations

from inclavate.types import SessionId
from node.slot_share import fair_victim


def sessions(**by_source: int) -> dict[SessionId, str]:
    return {SessionId(f"{source}{i}"): source for source, n in by_source.items() for i in range(n)}


def test_a_lone_busy_source_never_loses_a_slot_to_itself() -> None:
    assert fair_victim(sessions(a=8), {}, "a") is None


def test_the_source_holding_the_most_gives_up_its_longest_idle_session() -> None:
    held = sessions(hoarder=6, b=1, c=1)
    used = {sid: float(i) for i, sid in enumerate(held)}
    used[SessionId("hoarder3")] = -1.0
    assert fair_victim(held, used, "newcomer") == SessionId("hoarder3")
    assert fair_victim(held, used, "b") == SessionId("hoarder3")


def test_shares_converge_and_then_nobody_is_evicted() -> None:
    assert fair_victim(sessions(a=5, b=3), {}, "b") == SessionId("a0")  # 5 > 3 + 1
    assert fair_victim(sessions(a=4, b=4), {}, "b") is None
    assert fair_victim(sessions(a=4, b=3), {}, "b") is None  # one apart: taking would only swap
    assert fair_victim(sessions(a=1, b=1, c=1, d=1), {}, "e") is None  # one each, e.g. many identities


def test_sessions_with_work_in_the_batch_being_built_are_not_evicted() -> None:
    held = sessions(a=3)
    assert fair_victim(held, {SessionId("a0"): 0.0}, "b", busy={SessionId("a0")}) in {SessionId("a1"), SessionId("a2")}
    assert fair_victim(held, {}, "b", busy=set(held)) is None


def test_a_source_that_just_lost_a_session_is_spared_until_its_interval_ends() -> None:
    """Opening and closing sessions over and over must not make a busy entry replay one
    session after another: the next busiest may give one up instead, or nobody."""
    assert fair_victim(sessions(a=6, b=3), {}, "c", spared={"a"}) == SessionId("b0")
    assert fair_victim(sessions(a=6, b=1), {}, "c", spared={"a"}) is None


def test_a_previous_hop_naming_a_new_entry_per_session_gets_one_source_s_share() -> None:
    """After a first stage, a source is the previous hop with the entry it names; a peer with
    a record of the range before the stage names any entry it likes. One entry per session
    made it as many sources as it wanted, each a newcomer holding none: it took every slot
    but one of an honest entry's (3 of 4 here), and then no honest newcomer evicted it."""
    held = {SessionId(f"e{i}"): "A>E" for i in range(4)}
    taken = 0
    for i in range(4):
        victim = fair_victim(held, {}, f"H>r{i}")
        if victim is None:
            break
        del held[victim]
        held[SessionId(f"h{i}")] = f"H>r{i}"
        taken += 1
    assert taken == 2, held  # equal shares between the two previous hops, as between two sources
    # Entries behind one previous hop still share fairly between themselves.
    assert fair_victim(sessions(**{"A>E": 5, "A>F": 1, "B>G": 2}), {}, "A>F") == SessionId("A>E0")
    assert fair_victim(sessions(**{"A>E": 3, "B>G": 1}), {}, "C>F") == SessionId("A>E0")


def test_a_previous_hop_holding_every_slot_one_named_entry_each_gives_one_up() -> None:
    """A peer with a record of the range before a stage (a Joining one will do) is a known
    previous hop there: naming a new entry per session, it held every slot of the stage, one
    per named source, and no newcomer could take any (one each, as with many identities),
    so every chat through the stage waited out its admission timeout. Between previous hops
    it is their totals that are shared fairly: it keeps no more than one source's share."""
    held = {SessionId(f"h{i}"): f"H>r{i}" for i in range(4)}
    taken = 0
    for i in range(4):
        victim = fair_victim(held, {}, "A>E")
        if victim is None:
            break
        assert held[victim].startswith("H>")
        del held[victim]
        held[SessionId(f"e{i}")] = "A>E"
        taken += 1
    assert taken == 2, held


def test_a_previous_hop_that_just_lost_a_session_is_spared_by_other_hops() -> None:
    """Entries behind one previous hop are sources of their own: spared one by one, a peer
    opening and closing sessions took one from each in turn. Within the hop they still
    share fairly."""
    held = {SessionId(f"e{i}"): f"A>E{i}" for i in range(4)}
    assert fair_victim(held, {}, "H>r0") is not None
    assert fair_victim(held, {}, "H>r0", spared={"A"}) is None
    assert fair_victim(sessions(**{"A>E": 3}), {}, "A>F", spared={"A"}) == SessionId("A>E0")
