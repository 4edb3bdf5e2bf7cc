"""The thread-wait policy a peer process chooses before llama.cpp loads (node/__init__.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
