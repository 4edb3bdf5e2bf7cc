"""The thread-wait policy a peer process chooses before llama.cpp loads (node/__init__.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "INCLAVATE_COLOCATED", "INCLAVATE_THREAD_WAIT_DEFAULTED")


def wait_env_of_child(**env: str) -> dict[str, str]:
    """The wait variables a fresh process has after ``import node``, started with ``env``."""
    base = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    code = "import json, os, node; print(json.dumps({k: os.environ[k] for k in %r if k in os.environ}))" % (WAIT_VARS[:2],)
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_lone_peer_spins_a_bounded_while_then_sleeps_with_as_many_teams_as_it_likes() -> None:
    assert wait_env_of_child() == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize("flag", ["1", "yes"])
def test_a_colocated_peer_sleeps_at_once(flag: str) -> None:
    assert wait_env_of_child(INCLAVATE_COLOCATED=flag) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_users_own_setting_wins() -> None:
    assert wait_env_of_child(OMP_WAIT_POLICY="ACTIVE", INCLAVATE_COLOCATED="1") == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert wait_env_of_child(GOMP_SPINCOUNT="5") == {"GOMP_SPINCOUNT": "5"}


def test_a_default_inherited_from_a_parent_is_chosen_again() -> None:
    inherited = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000",
                 "INCLAVATE_THREAD_WAIT_DEFAULTED": "OMP_WAIT_POLICY,GOMP_SPINCOUNT"}  # fmt: skip
    assert wait_env_of_child(**inherited, INCLAVATE_COLOCATED="1") == {"OMP_WAIT_POLICY": "PASSIVE"}
    older = {"GOMP_SPINCOUNT": "1000", "INCLAVATE_THREAD_WAIT_DEFAULTED": "GOMP_SPINCOUNT"}  # one name, before
    assert wait_env_of_child(**older, INCLAVATE_COLOCATED="1") == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(("env", "alike"), [
    ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}, True),  # a lone peer's default
    ({"OMP_WAIT_POLICY": "PASSIVE"}, True),  # co-located peers': every barrier sleeps anyway
    ({"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "1k"}, True),
    ({"GOMP_SPINCOUNT": "50"}, True),  # below the throttled count of 100
    ({}, False),  # libgomp's own default: ~300k spins, throttled to 100
    ({"GOMP_SPINCOUNT": "1000"}, False),  # throttled to 100 once there are two teams
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False),  # spins forever, throttled to 1000
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}, False),
    ({"GOMP_SPINCOUNT": "infinite"}, False),
    ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "lots"}, False),  # libgomp would not parse it
])  # fmt: skip
def test_whether_a_second_openmp_team_waits_like_the_first(env: dict[str, str], alike: bool) -> None:
    from node import teams_spin_alike

    assert teams_spin_alike(env) is alike


def test_a_peer_told_its_threads_have_cores_spins_a_bounded_while() -> None:
    assert wait_env_of_child(INCLAVATE_COLOCATED="0") == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize(("peers", "cores", "shared"), [
    (3, 8, 2),  # ./scripts/run on an 8-core laptop: a lone stream's prompt on 8, the rest on 2 a peer
    (1, 2, 2),
    (2, 2, 1),
    (3, 2, 1),  # one thread each for the rest: no barrier to wait at
    (4, 16, 4),
])  # fmt: skip
def test_the_local_swarm_gives_a_lone_stream_every_core_and_splits_them_for_the_rest(
        peers: int, cores: int, shared: int) -> None:  # fmt: skip
    from inclavate.local_swarm import split_cores

    split = split_cores(peers, cores)
    assert (split.threads, split.shared) == (cores, shared)
    assert shared * peers <= cores or shared == 1  # threads computing at once fit the cores


def test_inclavate_swarm_tells_its_peers_to_spin_a_while_at_a_barrier(tmp_path: Path) -> None:
    """Its peers' threads computing at once have a core each: sleeping at once at a barrier
    ran a 2-thread peer at 0.36x (the swarm's default until 2026-12-05)."""
    from inclavate.swarm_cmd import open_swarm

    for cores in (2, 8):
        swarm = open_swarm(tmp_path, 3, "f32", {}, cores=cores)
        args = swarm.peer_args
        assert swarm.colocated is False
        assert args[args.index("--threads") + 1] == str(cores)
        assert args[args.index("--shared-threads") + 1] == str(max(1, cores // 3))


def test_inclavate_swarm_gives_a_decode_step_the_cores_the_other_peers_leave(tmp_path: Path) -> None:
    """On the 2-core VM 3 peers decoded one stream 9-24% faster with one thread a step than
    with two (2026-12-07); a whole peer alone is faster at every core."""
    from inclavate.swarm_cmd import open_swarm

    for peers, cores, step in ((3, 2, 1), (2, 2, 1), (1, 2, 2), (3, 8, 6), (1, 8, 8)):
        args = open_swarm(tmp_path, peers, "f32", {}, cores=cores).peer_args
        assert args[args.index("--step-threads") + 1] == str(step)  # the cores the other peers' hand-offs leave
    args = open_swarm(tmp_path, 3, "f32", {}, cores=2, step_threads=2).peer_args
    assert args[args.index("--step-threads") + 1] == "2"
