"""The conversation of one WebSocket, turn by turn, for trimming its turns (pure).

Codex sends the whole input once (its prewarm, `"generate": false`) and then each turn
as what it adds to the previous response (`previous_response_id`, `Turns.continues`):
the upstream holds the conversation. To trim a turn the relay needs all of it: the
input of the turn a response answered and that response's output (`Turns.completed`),
then the new turn's input. `SocketConversation` keeps that for one socket, and says
what a turn asks about in whole; a turn it cannot put together (it continues a
response this socket did not carry) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..apis.api import Turns
from ..apis.shape import Shape


@dataclass(slots=True, eq=False)
class Turn:
    """A turn in flight: what it asks as one request, and what trimming made of it."""

    request: dict[str, Any]
    """The turn as one request with the whole conversation (no `type`, no
    `previous_response_id`): what is trimmed, and trimmed again after a refusal."""
    items: list
    """Its whole conversation (the request's items, as the client meant them)."""
    model: str | None
    stats: dict[str, Any]
    """Trimming's stats, shared with the turn's record: updated in place after a refusal."""
    resent: bool = False


@dataclass(slots=True)
class SocketConversation:
    protocol: Turns
    shape: Shape
    response_id: str | None = None
    """The last response completed on this socket."""
    history: list | None = None
    """Its conversation: the input of the turn it answered, then its output."""
    turn: Turn | None = None
    """The turn in flight."""

    def whole(self, body: dict[str, Any]) -> tuple[dict[str, Any], list] | None:
        """A turn's request (`body`, a `response.create`) as one request carrying the whole
        conversation, and that conversation; None when part of it is unknown."""
        items = self.shape.items(body)
        if not isinstance(items, list):
            return None
        previous = self.protocol.continues(body)
        if previous is not None:
            if previous != self.response_id or self.history is None:
                return None
            items = [*self.history, *items]
        request = {k: v for k, v in body.items() if k not in ("type", "previous_response_id")}
        return {**request, self.shape.items_key: items}, items

    def started(self, turn: Turn | None) -> None:
        """A turn went upstream (None: one whose conversation is not known)."""
        self.turn = turn
        if turn is None:
            self.history = self.response_id = None

    def completed(self, response_id: str, output: list) -> None:
        """The turn's response completed: the next turn may continue it."""
        turn, self.turn = self.turn, None
        self.response_id = response_id
        self.history = None if turn is None else [*turn.items, *output]
