"""What a volunteer reads first: README.md's instructions must work when followed literally."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_says_where_the_inclavate_command_is_before_using_it() -> None:
    """``./scripts/run`` installs ``inclavate`` into ``.venv/bin`` and puts nothing on PATH;
    before, the README went straight from it to ``inclavate peer ...`` ("Joining peers by
    hand"), which a new shell answers with "command not found"."""
    text = README.read_text()
    first_use = re.search(r"^inclavate \w+", text, re.MULTILINE)
    assert first_use is not None
    before = text[: first_use.start()]
    assert "source .venv/bin/activate" in before and ".venv/bin/inclavate" in before
