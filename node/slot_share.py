"""Who gives up a session slot when a stage has none left: fair shares between sources.

A stage's slots (its KV cache sequences) are taken first come, first served; a session
holds its slot until it closes or idles out (10 minutes). Any peer may be an entry and send
token ids to a first stage, and a registry record costs nothing, so one identity could open
every slot of a stage and keep it (a step now and then) while everyone else's sessions
waited their admission timeout and failed. When a new session finds every slot taken, the
source (the peer feeding its sessions) holding the most gives up its longest-idle session,
if it holds at least two more than the newcomer's source. A lone busy entry (every slot
its own, nobody else asking) never loses one; two sources converge to equal shares, each
new session of the smaller taking one from the larger; a hoarder keeps no more than an
honest entry asks to leave it. Identities are free, so a hoarder with many of them, each
holding one slot, is not displaced by this: that is the residual (docs/ARCHITECTURE.md,
threat model).

After a first stage a session's source is the previous hop with the entry it names, and the
hop names what it likes: entries behind one previous hop share by source, previous hops by
their totals (one identity's share however many entries it names).

Eviction is also a weapon: a peer that opens and closes sessions over and over would take a
slot from a busy honest entry each time, and each costs that entry a replay of the whole
context. So a source loses at most one session per interval (the stage's
``evict_interval_s``, 10 s): its other sessions are ``spared`` until then.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Mapping

from inclavate.types import SessionId


def fair_victim(sources: Mapping[SessionId, str], last_used: Mapping[SessionId, float], newcomer: str,
                busy: Container[SessionId] = (), spared: Container[str] = ()) -> SessionId | None:  # fmt: skip
    """The session to evict so that ``newcomer``'s new session gets a slot, or None (it
    waits, as before). ``sources``: each held session's source; ``busy``: sessions that may
    not be evicted now (they have work in the batch being assembled); ``spared``: sources
    and previous hops (:func:`hop_of`) that lost a session too lately to lose another."""
    counts = Counter(sources.values())
    hops = Counter(map(hop_of, sources.values()))
    hop = hop_of(newcomer)

    def unfair(source: str) -> bool:  # to the newcomer: within its hop by source, else by hop
        if hop_of(source) == hop:
            return counts[source] > counts[newcomer] + 1
        return hops[hop_of(source)] > hops[hop] + 1

    def spares(source: str) -> bool:  # a hop's spare counts where its totals decide
        return source in spared or (hop_of(source) != hop and hop_of(source) in spared)

    candidates = [sid for sid, source in sources.items() if unfair(source) and sid not in busy and not spares(source)]
    if not candidates:
        return None

    def share(sid: SessionId) -> tuple[int, int]:
        return hops[hop_of(sources[sid])], counts[sources[sid]]

    most = max(map(share, candidates))
    return min((sid for sid in candidates if share(sid) == most), key=lambda sid: last_used.get(sid, 0.0))


def relayed(hop: str, entry: str) -> str:
    """The source of a session whose frames come from ``hop`` in the name of ``entry`` (a
    stage after the first; at a first stage the source is the entry itself)."""
    return f"{hop}>{entry}"


def hop_of(source: str) -> str:
    """Who vouches for ``source``: the previous hop that names the entry (:func:`relayed`),
    or the entry itself (token ids come from it). Entries named by one
    previous hop share its slots fairly among themselves; previous hops share by their
    totals. A hop names whatever entry it likes: counted by name alone, one peer with a
    record of the range before a stage (any state but Dead) was a fresh source per session,
    evicting others' sessions until each held one slot, and then never displaced."""
    return source.split(">", 1)[0]


def parties(source: str) -> tuple[str, ...]:
    """The peers ``source`` names: the previous hop and the entry it names (:func:`relayed`),
    or the entry alone (a first stage's source). Both fed the session: its frames came from
    the one, in the other's name (where its answers go)."""
    return tuple(source.split(">", 1))
