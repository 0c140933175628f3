"""The models written by hand: what the API answers in shapes the
generated ones cannot say (events of streams, rich results of code).
Everything else the SDK returns is a model of `_generated`."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Generic, List, Mapping, Optional, TypeVar, Union

from . import _generated as gen
from ._errors import StreamError


@dataclass(frozen=True)
class Stdout:
    """Output a command (or a cell) wrote to its standard output."""

    text: str


@dataclass(frozen=True)
class Stderr:
    """Output a command (or a cell) wrote to its standard error."""

    text: str


@dataclass(frozen=True)
class Exit:
    """The last event of a streamed command: it ended with this code."""

    exit_code: int


#: What `Sandbox.exec_stream` yields: output chunks, then one `Exit`.
ExecEvent = Union[Stdout, Stderr, Exit]


def exec_event(name: str, data: Mapping[str, Any]) -> Optional[ExecEvent]:
    """An exec stream's event; raises on `error`, None for unknown ones."""
    if name == "stdout":
        return Stdout(str(data.get("chunk", "")))
    if name == "stderr":
        return Stderr(str(data.get("chunk", "")))
    if name == "exit":
        return Exit(int(data["exit_code"]))
    if name == "error":
        raise StreamError(str(data.get("error", "the command failed")))
    return None


class Result:
    """One display of a cell (a MIME bundle): the last expression's value,
    a chart, a table. Binary formats (PNG, JPEG) come decoded."""

    def __init__(self, bundle: Mapping[str, Any]) -> None:
        self.bundle: Dict[str, Any] = dict(bundle)

    def _text(self, mime: str) -> Optional[str]:
        value = self.bundle.get(mime)
        return value if isinstance(value, str) else None

    def _binary(self, mime: str) -> Optional[bytes]:
        value = self._text(mime)
        return base64.b64decode(value) if value is not None else None

    @property
    def text(self) -> Optional[str]:
        return self._text("text/plain")

    @property
    def html(self) -> Optional[str]:
        return self._text("text/html")

    @property
    def markdown(self) -> Optional[str]:
        return self._text("text/markdown")

    @property
    def svg(self) -> Optional[str]:
        return self._text("image/svg+xml")

    @property
    def png(self) -> Optional[bytes]:
        return self._binary("image/png")

    @property
    def jpeg(self) -> Optional[bytes]:
        return self._binary("image/jpeg")

    @property
    def json(self) -> Any:
        value = self.bundle.get("application/json")
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value

    def formats(self) -> List[str]:
        """The MIME types this result has, e.g. `["text/plain", "image/png"]`."""
        return list(self.bundle)

    def __repr__(self) -> str:
        return f"Result(formats={self.formats()!r})"


@dataclass
class Execution:
    """A cell's outcome: its output, error and results."""

    stdout: str
    stderr: str
    #: 0, or 1 when the cell raised or was interrupted (bash: its status).
    exit_code: int
    duration_ms: int
    #: The formatted traceback (or `Name: value`) when the cell raised.
    error: Optional[str] = None
    results: List[Result] = field(default_factory=list)
    truncated: bool = False

    @classmethod
    def from_model(cls, model: gen.Execution) -> Execution:
        return cls(
            stdout=model.stdout,
            stderr=model.stderr,
            exit_code=model.exit_code,
            duration_ms=model.duration_ms,
            error=model.error,
            results=[Result(bundle) for bundle in model.results],
            truncated=bool(model.truncated),
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Execution:
        return cls.from_model(gen.Execution.from_json(data))

    @property
    def text(self) -> Optional[str]:
        """The text of the last result that has one (the cell's value)."""
        for result in reversed(self.results):
            if result.text is not None:
                return result.text
        return None


@dataclass(frozen=True)
class CellError:
    """A cell raised: the exception's name, value and traceback."""

    name: str
    value: str
    traceback: str


@dataclass(frozen=True)
class CellResult:
    """A display the cell produced while it ran."""

    result: Result


@dataclass(frozen=True)
class CellDone:
    """The last event of a streamed cell: its whole outcome."""

    execution: Execution


#: What `Sandbox.run_code_stream` yields: output, results, an error, then `CellDone`.
CodeEvent = Union[Stdout, Stderr, CellResult, CellError, CellDone]


def code_event(name: str, data: Mapping[str, Any]) -> Optional[CodeEvent]:
    """A streamed cell's event; raises when the stream itself failed."""
    if name == "stdout":
        return Stdout(str(data.get("text", "")))
    if name == "stderr":
        return Stderr(str(data.get("text", "")))
    if name == "result":
        return CellResult(Result(data))
    if name == "error":
        if "traceback" in data or "name" in data:
            return CellError(str(data.get("name", "")), str(data.get("value", "")), str(data.get("traceback", "")))
        raise StreamError(str(data.get("error", "the cell failed")))
    if name == "execution":
        return CellDone(Execution.from_json(data))
    return None


S = TypeVar("S")


@dataclass
class ForkTree(Generic[S]):
    """The children of a fork-tree, and those that did not start."""

    tree_id: Optional[str]
    parent_id: str
    #: RFC 3339: when the parent was captured.
    at: str
    children: List[S]
    errors: List[gen.ChildError]


@dataclass(frozen=True)
class DatabaseStats:
    """A database's figures, as its own server counts them (`databases.stats`)."""

    #: The server's whole version, e.g. `15.10 (Debian 15.10-0+deb12u1)`.
    postgres_version: str
    db_size_bytes: int
    #: Sessions open now, the query that counted them not included.
    connections: int
    max_connections: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DatabaseStats:
        return cls(
            postgres_version=str(data["postgres_version"]),
            db_size_bytes=int(data["db_size_bytes"]),
            connections=int(data["connections"]),
            max_connections=int(data["max_connections"]),
        )
