"""Headless Chromium for the dashboard tests: Debian's ``/usr/bin/chromium`` driven by
Playwright's Python package (``playwright install`` is never run: nothing is downloaded).

``scripts/setup`` installs Chromium when it can; where it is missing the tests skip and say so.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps dialling Google on a closed network.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
NETWORK_ERROR = "Failed to load resource"


def skip_reason() -> str | None:
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        return f"{CHROMIUM} is missing: scripts/setup installs Debian's chromium when run as root"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing: re-run scripts/setup (it is in the test extras)"
    return None


@dataclass
class Console:
    """What a page said on its console and which script errors it threw."""

    messages: list[tuple[str, str, str]] = field(default_factory=list)  # (type, text, url)
    page_errors: list[str] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        page.on("console", lambda m: self.messages.append((m.type, m.text, (m.location or {}).get("url", ""))))
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))

    def errors(self, *, allowed_statuses: tuple[int, ...] = (), allowed_paths: tuple[str, ...] = ()) -> list[str]:
        """Script errors and console errors, less the failed loads a test expects (a 404
        from an optional API shows on the console as a network error, not a script error)."""
        out = list(self.page_errors)
        for kind, text, url in self.messages:
            if kind != "error":
                continue
            expected = text.startswith(NETWORK_ERROR) and any(f"status of {s}" in text for s in allowed_statuses) \
                and any(p in url for p in allowed_paths)  # fmt: skip
            if not expected:
                out.append(f"{text} ({url})")
        return out

    def clear(self) -> None:
        self.messages.clear()
        self.page_errors.clear()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        executable = str(CHROMIUM) if CHROMIUM.exists() else shutil.which("chromium")
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
