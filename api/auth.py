"""Admin authentication: the ``X-Admin-Token`` header against ``--admin-token``.

A peer started without a token answers 403 on every admin route: there is no default
token to guess. The comparison is constant-time, and the token is never logged or sent to
another peer (admin commands for other peers travel signed by this peer instead).
"""

from __future__ import annotations

import hmac

from quart import request

from api.errors import Forbidden

HEADER = "X-Admin-Token"


def require_admin(token: str | None) -> None:
    if not token:
        raise Forbidden("admin routes are disabled: this peer was started without --admin-token")
    offered = request.headers.get(HEADER, "")
    if not hmac.compare_digest(offered.encode(), token.encode()):
        raise Forbidden(f"missing or invalid {HEADER}")
