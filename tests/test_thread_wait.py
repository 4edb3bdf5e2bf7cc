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


def test_a_lone_peer_spins_a_bounded_while_then_sleeps() -> None:
    assert wait_env_of_child() == {"GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize("flag", ["1", "yes"])
def test_a_colocated_peer_sleeps_at_once(flag: str) -> None:
    assert wait_env_of_child(INCLAVATE_COLOCATED=flag) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_users_own_setting_wins() -> None:
    assert wait_env_of_child(OMP_WAIT_POLICY="ACTIVE", INCLAVATE_COLOCATED="1") == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert wait_env_of_child(GOMP_SPINCOUNT="5") == {"GOMP_SPINCOUNT": "5"}


def test_a_default_inherited_from_a_parent_is_chosen_again() -> None:
    inherited = {"GOMP_SPINCOUNT": "1000", "INCLAVATE_THREAD_WAIT_DEFAULTED": "GOMP_SPINCOUNT"}
    assert wait_env_of_child(**inherited, INCLAVATE_COLOCATED="1") == {"OMP_WAIT_POLICY": "PASSIVE"}
