"""An entry's turns (``api.sessions.ActiveSessions``): when a refused chat is told to retry."""

from __future__ import annotations

import pytest
import trio

from api.errors import error_headers
from api.sessions import MAX_RETRY_AFTER_S, TURN_S_PRIOR, ActiveSessions, Busy, SessionClosed
from inclavate.types import SessionId


async def _generate(sessions: ActiveSessions, name: str, seconds: float) -> None:
    with sessions.admitting():
        pass
    async with sessions.track(SessionId(name)):
        await trio.sleep(seconds)


async def _refusal(sessions: ActiveSessions) -> Busy:
    with pytest.raises(Busy) as refused, sessions.admitting():
        pass
    return refused.value


async def test_a_refused_chat_is_told_to_retry_when_the_queue_ahead_of_it_should_have_run(
        autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """A fixed ``Retry-After: 2`` had a burst's refused chats retry at 2 and 4 s while the
    first admitted one ran 5.6 s: all ten retries met a full queue and failed with the
    openai SDK's RateLimitError, though the whole burst was served within 27 s (an audit,
    2026-12-07). The answer now covers the rounds of turns ahead, at the turns' mean length."""
    sessions = ActiveSessions(max_running=2, max_waiting=4)
    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(_generate, sessions, f"first {i}", 5.0)
        await trio.sleep(0.1)
        refused = await _refusal(sessions)  # 6 ahead, 2 at a time, no turn ended yet: 3 rounds of the prior
        assert refused.retry_after_s == 3 * TURN_S_PRIOR
        assert error_headers(refused)["Retry-After"] == str(int(3 * TURN_S_PRIOR))
    for i in range(6):  # the mean turn learns the 5 s
        await _generate(sessions, f"more {i}", 5.0)
    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(_generate, sessions, f"burst {i}", 5.0)
        await trio.sleep(0.1)
        refused = await _refusal(sessions)
        assert 3 * 4.5 <= refused.retry_after_s <= 3 * 5.0 + 1  # what 3 rounds of 5 s turns take
        nursery.cancel_scope.cancel()


async def test_the_retry_after_is_never_past_what_the_sdk_reads(autojump_clock: trio.abc.Clock) -> None:
    sessions = ActiveSessions(max_running=1, max_waiting=40)
    await _generate(sessions, "long", 600.0)
    async with trio.open_nursery() as nursery:
        for i in range(41):
            nursery.start_soon(_generate, sessions, f"queued {i}", 1.0)
        await trio.sleep(0.1)
        assert (await _refusal(sessions)).retry_after_s == MAX_RETRY_AFTER_S
        nursery.cancel_scope.cancel()


async def test_a_close_that_lands_as_the_client_leaves_leaves_nothing_behind() -> None:
    """``DELETE /sessions/:id`` as its streaming client left: the client's cancel ended the
    generation's block before its close was read, and the id stayed in the table of closed
    sessions for good, one per round (an audit, 2026-12-07)."""
    sessions = ActiveSessions()
    for i in range(50):
        session_id = SessionId(f"s{i}")
        with trio.CancelScope() as client:
            async with sessions.track(session_id):
                assert sessions.close(session_id)
                client.cancel()  # the client leaves just then
                await trio.sleep(0)
    assert not sessions._closed and len(sessions) == 0  # noqa: SLF001 - the table a stranger could grow
    with pytest.raises(SessionClosed):  # a close on its own still says so
        async with sessions.track(SessionId("alone")):
            assert sessions.close(SessionId("alone"))
            await trio.sleep(0)


async def test_a_close_of_a_session_waiting_for_its_turn_says_it_was_closed() -> None:
    """A session closed while it waits for a turn ends with SessionClosed (a 409), not a
    failure of the turn's bookkeeping (a review, 2026-12-07: a 500 for a while)."""
    sessions = ActiveSessions(max_running=1)
    outcome: list[BaseException] = []

    async def waiting() -> None:
        try:
            async with sessions.track(SessionId("queued")):
                raise AssertionError("it never had a turn")
        except BaseException as exc:  # noqa: BLE001 - what the route would see
            outcome.append(exc)

    async with sessions.track(SessionId("running")), trio.open_nursery() as nursery:
        nursery.start_soon(waiting)
        await trio.sleep(0.05)
        assert sessions.close(SessionId("queued"))
    assert [type(e) for e in outcome] == [SessionClosed] and not sessions._closed  # noqa: SLF001
