"""Who asked for a patch several addons share (not mitmproxy's): it stays in while anyone does."""

from __future__ import annotations


class Users:
    """The names (`by`) that asked for one patch; `install(by)` adds, `uninstall(by)` releases."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def add(self, by: str) -> None:
        self._names.add(by)

    def release(self, by: str | None) -> bool:
        """Drop `by` (None: everyone); True when no one is left, so the patch comes out."""
        if by is None:
            self._names.clear()
        else:
            self._names.discard(by)
        return not self._names
