"""Server-sent events as Clade writes them (§2.8): `event:` then `data:`
lines, a blank line ends an event, `:` lines are keep-alives."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, List, Optional


@dataclass(frozen=True)
class ServerSentEvent:
    event: str
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


class SSEDecoder:
    """Turns lines (without their line ending) into events."""

    def __init__(self) -> None:
        self._event = ""
        self._data: List[str] = []

    def feed(self, line: str) -> Optional[ServerSentEvent]:
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None

    def flush(self) -> Optional[ServerSentEvent]:
        """The last event of a stream that did not end with a blank line."""
        return self._dispatch()

    def _dispatch(self) -> Optional[ServerSentEvent]:
        if not self._data and not self._event:
            return None
        event = ServerSentEvent(self._event or "message", "\n".join(self._data))
        self._event, self._data = "", []
        return event
