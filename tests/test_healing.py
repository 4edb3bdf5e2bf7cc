"""Gap healing: who moves where, and why the swarm settles instead of oscillating."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import trio
from registry_helpers import MODEL, record, signed, view

from inclavate.healer import HealConfig, Healer
from inclavate.types import LayerRange, NodeId
from p2p.coverage import uncovered
from p2p.healing import HealPlan, Settle, heal_target, plan_heal
from p2p.identity import Identity
from p2p.placement import choose_range, holders
from p2p.records import NodeRecord, SignedRecord
from p2p.registry import Liveness, NodeView, Table, Verdict, apply

LIVENESS = Liveness()


def _swarm(d_state: str = "Dead") -> list[NodeView]:
    return [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20), view("d", 20, 30, d_state)]


def test_a_replicated_peer_moves_to_the_gap_a_dead_peer_left() -> None:
    assert plan_heal(_swarm("Dead"), 30) == HealPlan(LayerRange(20, 30), NodeId("b"))
    # Degraded (a few heartbeats missed) already counts as gone; settle absorbs a blip.
    assert plan_heal(_swarm("Degraded"), 30) == HealPlan(LayerRange(20, 30), NodeId("b"))
    assert plan_heal(_swarm("Ready"), 30) is None


def test_only_a_peer_whose_every_layer_is_held_twice_moves() -> None:
    views = [view("a", 0, 10), view("b", 10, 20), view("d", 20, 30, "Dead")]
    assert plan_heal(views, 30) is None
    # b is covered only partly by c (it would open 15-20): c, covered whole by b, moves.
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 15), view("d", 20, 30, "Dead")]
    assert plan_heal(views, 30) == HealPlan(LayerRange(20, 30), NodeId("c"))
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 12, 25), view("d", 25, 30, "Dead")]
    assert plan_heal(views, 30) is None


def test_the_most_replicated_span_gives_the_mover_then_the_lowest_id() -> None:
    views = [view("z1", 0, 10), view("z2", 0, 10), view("z3", 0, 10), view("a1", 10, 20), view("a2", 10, 20)]
    assert plan_heal(views, 30) == HealPlan(LayerRange(20, 30), NodeId("z1"))


def test_joining_peers_count_as_replicas_only_once_ready() -> None:
    # c is still loading 10-20: b is not spare yet (c might fail to load).
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20, "Joining"), view("d", 20, 30, "Dead")]
    assert plan_heal(views, 30) is None
    # A newcomer already loading the gap has closed it.
    views = [*_swarm(), view("e", 20, 30, "Joining")]
    assert plan_heal(views, 30) is None


def test_idle_and_draining_peers_never_move_and_hold_nothing() -> None:
    views = [view("a", 0, 10), view("b", 10, 20, idle=True), view("c", 10, 20), view("c2", 10, 20),
             view("d", 20, 30, "Dead")]  # fmt: skip
    assert plan_heal(views, 30) == HealPlan(LayerRange(20, 30), NodeId("c"))
    # A legacy node (its range fixed at registration) is never elected, and makes nobody spare:
    # anyone may register one for a peer to relay, and one on an honest sole holder's span had
    # that holder drain and move, then vanished, a real gap opened, span after span; a
    # "draining" one is no mover on its way either, and held every gap open for ever with a
    # fresh id each minute (an audit, 2026-12-07).
    views = [view("a", 0, 10), view("b", 10, 20, relayed=True), view("c", 10, 20), view("d", 20, 30, "Dead")]
    assert plan_heal(views, 30) is None
    views = [view("a", 0, 10), view("b", 10, 20, relayed=True), view("c", 10, 20), view("c2", 10, 20),
             view("d", 20, 30, "Dead")]  # fmt: skip
    assert plan_heal(views, 30) == HealPlan(LayerRange(20, 30), NodeId("c"))
    views = [*views, view("x:fresh", 0, 10, relayed=True, draining=True)]
    assert plan_heal(views, 30) == HealPlan(LayerRange(20, 30), NodeId("c"))
    # A volunteer stopping the only holder of 20-30 opens the gap at once.
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20), view("d", 20, 30, draining=True)]
    assert plan_heal(views, 30) == HealPlan(LayerRange(20, 30), NodeId("b"))


def test_nobody_else_moves_while_a_mover_drains() -> None:
    # b was elected and drains its sessions before it announces the gap: c must wait.
    views = [view("a", 0, 10), view("b", 10, 20, draining=True), view("c", 10, 20), view("c2", 10, 20),
             view("d", 20, 30, "Dead")]  # fmt: skip
    assert plan_heal(views, 30) is None


def test_the_mover_takes_the_gap_as_far_as_it_can_hold() -> None:
    plan = HealPlan(LayerRange(20, 30), NodeId("b"))
    assert heal_target(plan, 10) == LayerRange(20, 30)
    assert heal_target(plan, 100) == LayerRange(20, 30)
    assert heal_target(plan, 4) == LayerRange(20, 24)
    with pytest.raises(ValueError):
        heal_target(plan, 0)


def test_a_plan_acts_only_after_it_stood_unchanged_for_the_settle_time() -> None:
    settle = Settle(5.0)
    plan = HealPlan(LayerRange(20, 30), NodeId("b"))
    assert settle.observe(plan, 100.0) is None
    assert settle.observe(plan, 104.9) is None
    assert settle.observe(plan, 105.0) == plan
    # The dead peer came back for a moment: start over.
    assert settle.observe(None, 106.0) is None
    assert settle.observe(plan, 107.0) is None
    assert settle.observe(plan, 112.0) == plan
    # Another mover elected: start over too.
    other = HealPlan(LayerRange(20, 30), NodeId("c"))
    assert settle.observe(other, 113.0) is None
    settle.reset()
    assert settle.observe(other, 113.5) is None


def _apply_heals(views: list[NodeView], n_layers: int, capacity: dict[str, int]) -> list[tuple[str, LayerRange]]:
    """Run the election round after round like the swarm does (each move completes before
    the next plan); return the moves made."""
    moves = []
    for _ in range(50):
        plan = plan_heal(views, n_layers)
        if plan is None:
            return moves
        target = heal_target(plan, capacity[plan.mover])
        before = uncovered((v.record.layers for v in holders(views, n_layers)), n_layers)
        views = [
            NodeView(v.record.replace(start_layer=target.start, end_layer=target.end), "Ready")
            if v.record.node_id == plan.mover else v
            for v in views
        ]  # fmt: skip
        after = uncovered((v.record.layers for v in holders(views, n_layers)), n_layers)
        assert sum(map(len, after)) < sum(map(len, before)), "a move must shrink the uncovered layers"
        assert all(any(g.contains(a) for g in before) for a in after), "a move must never open a new gap"
        moves.append((plan.mover, target))
    raise AssertionError("healing did not settle")


def test_random_swarms_settle_without_ever_opening_a_gap() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n_layers = rng.choice([12, 30])
        views, capacity = [], {}
        for i in range(rng.randint(2, 9)):
            start = rng.randrange(n_layers)
            end = rng.randint(start + 1, n_layers)
            state = rng.choice(["Ready", "Ready", "Ready", "Dead", "Degraded", "Joining"])
            name = f"p{i}"
            views.append(view(name, start, end, state, n_layers=n_layers))
            capacity[name] = rng.randint(1, n_layers)
        moves = _apply_heals(views, n_layers, capacity)
        movers = [m for m, _ in moves]
        assert len(set(movers)) == len(movers), "a peer that healed a gap is never moved again"


def test_the_example_swarm_heals_with_one_move() -> None:
    moves = _apply_heals(_swarm(), 30, {"a": 10, "b": 10, "c": 10})
    assert moves == [("b", LayerRange(20, 30))]


def test_a_newcomer_does_not_join_a_draining_span() -> None:
    views = [view("a", 0, 15), view("b", 15, 30, draining=True)]
    assert choose_range(views, 30, 15) == LayerRange(15, 30)


def test_the_draining_flag_travels_signed_and_parses_tolerantly() -> None:
    alice = Identity.generate()
    rec = SignedRecord.sign(record(alice, 0, 10, draining=True), alice)
    again = SignedRecord.decode(rec.encode())
    assert again.verified() and again.record.draining is True
    data = record(alice, 0, 10).to_json()
    del data["draining"]  # a peer from before the field existed
    assert NodeRecord.from_json(data).draining is False
    assert NodeRecord.from_json({**data, "draining": "yes"}).draining is False


async def test_the_healer_moves_the_elected_peer_once_after_settling(autojump_clock: trio.abc.Clock) -> None:
    table = _swarm()
    moves: dict[str, list[tuple[float, LayerRange]]] = {"b": [], "c": []}

    def healer(me: str) -> Healer:
        async def move(target: LayerRange, still_elected: Callable[[], bool]) -> bool:
            assert still_elected()
            moves[me].append((trio.current_time(), target))
            return True

        config = HealConfig(settle_s=4.0, cooldown_s=60.0)
        return Healer(NodeId(me), 30, 10, lambda: table, lambda: True, move, config)

    start = await _run_healers([healer("b"), healer("c")], 30)
    assert [t for _, t in moves["b"]] == [LayerRange(20, 30)] and moves["c"] == []
    assert moves["b"][0][0] - start >= 4.0, "moved before the plan settled"


async def test_a_mover_whose_gap_was_taken_meanwhile_stays(autojump_clock: trio.abc.Clock) -> None:
    table = _swarm()
    h = Healer(NodeId("b"), 30, 10, lambda: table, lambda: True, _never_moves)
    # b drains; meanwhile a newcomer loads 20-30: b is no longer needed there.
    table[1] = view("b", 10, 20, draining=True)
    assert h.still_elected(LayerRange(20, 30))
    table.append(view("e", 20, 30, "Joining"))
    assert not h.still_elected(LayerRange(20, 30))


async def _run_healers(healers: list[Healer], seconds: float) -> float:
    """Run ``healers`` side by side for ``seconds``; when they started."""
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        for h in healers:
            nursery.start_soon(h.run)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    return start


async def _never_moves(target: LayerRange, still_elected: Callable[[], bool]) -> bool:
    raise AssertionError("unexpected move")


@pytest.mark.parametrize("liar", [view("A", 10, 20), view("z", 10, 20, draining=True)],
                         ids=["elected_and_never_moves", "says_it_drains"])  # fmt: skip
async def test_a_record_that_never_moves_holds_no_gap_open(autojump_clock: trio.abc.Clock, liar: NodeView) -> None:
    """A stranger publishes a record holding a replicated span (10-20, beside b and c) and
    then does nothing: with the lowest id it is elected to every gap and never moves, or,
    saying it drains, it is "a mover on its way" everyone waits for. Either way, no gap of
    the model healed for as long as the record was published (a free record: nothing
    proves a peer holds or moves anything). Now a peer waited on ``stuck_s`` is passed
    over, and the next elected heals the gap."""
    table = [*_swarm(), liar]
    moves: dict[str, list[tuple[float, LayerRange]]] = {"b": [], "c": []}

    def healer(me: str) -> Healer:
        async def move(target: LayerRange, still_elected: Callable[[], bool]) -> bool:
            assert still_elected()
            moves[me].append((trio.current_time(), target))
            table[:] = [view(me, target.start, target.end) if v.record.node_id == me else v for v in table]
            return True

        return Healer(NodeId(me), 30, 10, lambda: table, lambda: True, move, HealConfig(settle_s=4.0))  # stuck_s: 60 s

    start = await _run_healers([healer("b"), healer("c")], 300)
    assert [t for _, t in moves["b"]] == [LayerRange(20, 30)] and moves["c"] == [], moves
    assert moves["b"][0][0] - start <= 60.0 + 4.0 + 2.0


def test_gaps_mark_each_distinct_range_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The healer asks for the gaps twice a second: a swarm of 1,000 peers over 10 distinct
    ranges hands the coverage check 10 ranges, not 1,000 (it built and marked one per
    record: ~4 ms of the event loop a time at 4,096 records). The answers stay the same."""
    import p2p.healing as healing

    handed: list[int] = []

    def counted(ranges, n_layers):  # type: ignore[no-untyped-def]
        ranges = list(ranges)
        handed.append(len(ranges))
        return uncovered(ranges, n_layers)

    monkeypatch.setattr(healing, "uncovered", counted)
    spans = [(i * 3, i * 3 + 3) for i in range(10)]
    views = [view(f"n{i:04d}", *spans[i % 10]) for i in range(1000)]
    assert plan_heal(views, 30) is None and healing.waited_on(views, 30) == []
    assert handed == [10, 10]
    # one span left only to a silent peer: a gap, and the same plan as before
    views = [v for v in views if v.record.layers != LayerRange(0, 3)] + [view("lone", 0, 3, state="Degraded")]
    plan = plan_heal(views, 30)
    assert plan == HealPlan(LayerRange(0, 3), plan.mover) and max(handed) <= 10


class _Gossip:
    """A registry table fed as gossip would feed it, on a clock the test moves (ms)."""

    def __init__(self, now_ms: int = 1_000_000) -> None:
        self.now_ms, self.table = now_ms, Table()
        self.layers: dict[str, dict[str, object]] = {}
        self.listings = 0

    def beat(self, who: Identity, start: int | None = None, end: int | None = None, **changes: object) -> None:
        """``who`` publishes (a heartbeat, or with ``changes``)."""
        held = self.layers.setdefault(who.peer_id, {})
        held.update(changes, **({"start_layer": start, "end_layer": end} if start is not None else {}))
        held["seq"] = max(self.now_ms, int(held.get("seq", 0)) + 1)  # type: ignore[call-overload]
        fields = {k: v for k, v in held.items() if k not in ("start_layer", "end_layer")}
        rec = signed(who, held["start_layer"], held["end_layer"], ts_ms=self.now_ms,  # type: ignore[arg-type]
                     uptime_s=self.now_ms // 1000 % 1000, **fields)  # fmt: skip
        self.table, verdict = apply(self.table, rec, self.now_ms, LIVENESS)
        assert verdict is Verdict.ACCEPTED, verdict

    def views(self) -> list[NodeView]:
        self.listings += 1
        return list(self.table.views(self.now_ms, LIVENESS))

    def key(self) -> object:
        return self.table.heal_key(MODEL, self.now_ms, LIVENESS)


def _healer(gossip: _Gossip, me: str, *, keyed: bool) -> Healer:
    return Healer(NodeId(me), 30, 10, gossip.views, lambda: True, _never_moves, HealConfig(settle_s=4.0),
                  version=gossip.key if keyed else None)  # fmt: skip


def test_a_look_on_an_unchanged_registry_lists_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The healer looks each second: while the registry's heal key stands (only heartbeats
    arrive) a look lists no views and runs no election, yet its timers run: the peer
    elected and never moving is still passed over at ``stuck_s``, and a change (a peer
    draining) is seen at the next look."""
    gossip = _Gossip()
    a, b, c, d = (Identity.generate() for _ in range(4))
    for who, start in ((a, 0), (b, 10), (c, 10), (d, 20)):
        gossip.beat(who, start, start + 10)
    gossip.beat(d, state="Dead")  # 20-30: a gap; b or c is elected, and never moves here
    healer, settle = _healer(gossip, "observer", keyed=True), Settle(4.0)
    elected = plan_heal(gossip.views(), 30)
    assert elected is not None and elected.gap == LayerRange(20, 30)
    gossip.listings = 0
    import inclavate.healer as healer_module

    elections: list[frozenset[str]] = []

    def counted(views, n_layers, passed_over=frozenset()):  # type: ignore[no-untyped-def]
        elections.append(passed_over)
        return plan_heal(views, n_layers, passed_over)

    monkeypatch.setattr(healer_module, "plan_heal", counted)
    for second in range(1, 71):
        gossip.now_ms += 1000
        if second % 2 == 0:
            for who in (a, b, c):
                gossip.beat(who)
        assert healer.check(settle, float(second)) is None  # the observer is never the mover
        if second == 59:
            assert gossip.listings == 1 and len(elections) == 1, "looked again on an unchanged registry"
    assert healer.passed_over(70.0) == {elected.mover}, "stuck_s passed and nobody was passed over"
    assert elections == [frozenset(), frozenset({elected.mover})]  # elected again without it, once
    assert gossip.listings == 1  # from the same listing: the registry did not change
    gossip.beat(c if elected.mover == b.peer_id else b, draining=True)
    healer.check(settle, 71.0)
    assert gossip.listings == 2 and len(elections) == 3


def test_a_keyed_healer_decides_as_one_that_lists_every_look() -> None:
    """Random heartbeats, drains, layer changes, joins, deaths and silences (nodes ageing
    into Degraded and Dead with no record arriving) over 10 minutes: the healer keyed by
    the registry's heal key and one that lists the registry at every look act on the same
    plans at the same seconds and wait on, and pass over, the same peers; the keyed one
    lists far less."""
    rng = random.Random(5)
    gossip = _Gossip()
    peers = [Identity.generate() for _ in range(7)]
    silent: set[int] = set()
    for i, who in enumerate(peers):
        gossip.beat(who, i % 3 * 10, i % 3 * 10 + 10)
    keyed, listing = _healer(gossip, peers[0].peer_id, keyed=True), _healer(gossip, peers[0].peer_id, keyed=False)
    settles = Settle(4.0), Settle(4.0)
    looks, plans, aged, last = 0, set(), 0, {}
    for second in range(1, 601):
        gossip.now_ms += 1000
        for i, who in enumerate(peers):
            if i not in silent and (second + i) % 2 == 0:
                gossip.beat(who)
        changed = rng.random() < 0.1
        if changed:
            i = rng.randrange(len(peers))
            who = peers[i]
            change = rng.choice(["silent", "back", "drain", "stay", "move", "dead"])
            if change == "silent":
                silent.add(i)
            elif change in ("back", "drain", "stay", "dead", "move"):
                silent.discard(i)
                start = rng.choice([0, 10, 20])
                gossip.beat(who, **{"back": {}, "drain": {"draining": True}, "stay": {"draining": False},
                                    "dead": {"state": "Dead"}, "move": {"start": start, "end": start + 10, "state": "Ready"}}[change])  # type: ignore[arg-type]  # fmt: skip
        before = gossip.listings
        first = keyed.check(settles[0], float(second))
        looks += gossip.listings - before
        assert first == listing.check(settles[1], float(second)), second
        assert keyed._waiting == listing._waiting and keyed._passed_over == listing._passed_over, second
        answers = {name: answer for name, (_, answer) in keyed._answers.items()}
        assert answers == {name: answer for name, (_, answer) in listing._answers.items()}, second
        plans.add(answers["plan"])
        aged += not changed and answers != last
        last = answers
    assert looks < 600 / 3, looks
    assert len(plans) >= 3 and aged >= 3, (plans, aged)  # several elections, some by silence alone
