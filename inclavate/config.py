"""Where Inclavate keeps its state on this machine.

Everything a peer owns on disk (pulled models, the local catalog overlay, later its
identity key and settings) lives under one directory so that a user can move, back up or
wipe it as a unit, and tests can point a whole process at a temporary one through the
environment alone.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "INCLAVATE_HOME"
"""Environment variable that overrides the state directory (tests set it to a tmp dir)."""

DEFAULT_HOME = Path("~/.inclavate")

ADMIN_TOKEN_ENV = "INCLAVATE_ADMIN_TOKEN"
"""Environment variable holding a peer's admin token (unlike ``--admin-token``, it does not
show in the process list)."""


def inclavate_home() -> Path:
    """The state directory: ``$INCLAVATE_HOME`` if set and non-empty, else ``~/.inclavate``.

    Returned absolute but not created: read-only commands (``inclavate models``) should not
    leave directories behind; whoever writes creates what it needs.
    """
    configured = os.environ.get(HOME_ENV, "").strip()
    return Path(configured or DEFAULT_HOME).expanduser().resolve()
