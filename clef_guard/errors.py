"""Every error clef-guard raises, in one tree.

::

    ClefGuardError
    ├── RequestError            a ClassifierRequest the engine cannot answer
    │   └── UnsupportedQuestionError
    ├── PolicyError             a policy file that cannot be loaded as written
    ├── ToolBlockedError        a tool call the guard stopped (where the only way is to raise)
    ├── ModelLoadError          a backbone, adapter or head that cannot be loaded
    └── EngineError             the engine failed while answering
        ├── EngineTimeoutError
        └── RemoteEngineError   a System One server failed, refused the call, or answered out of spec

Each message names what is at fault (a question id and field, a path) and what to do.
"""

from __future__ import annotations


class ClefGuardError(Exception):
    """Base class of every error raised by clef-guard."""


class RequestError(ClefGuardError, ValueError):
    """A request the engine cannot answer as written.

    ``question`` is the id of the question at fault (``None`` for the request itself)
    and ``field`` the field inside it, so a caller can point at the exact place.
    """

    def __init__(self, message: str, *, question: str | None = None, field: str | None = None) -> None:
        where = ""
        if question is not None:
            where = f"question {question!r}" + (f", field {field!r}" if field else "") + ": "
        elif field is not None:
            where = f"field {field!r}: "
        super().__init__(where + message)
        self.question = question
        self.field = field


class UnsupportedQuestionError(RequestError):
    """A question type this engine does not answer (``Box``)."""


class PolicyError(ClefGuardError, ValueError):
    """A policy (or calibration) file that cannot be loaded as written.

    The message reads ``file:line:column: field: problem (hint)`` so editors and CI
    logs can jump to the spot; the parts are also attributes.
    """

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        line: int | None = None,
        column: int | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        where = ":".join(str(part) for part in (file or "<policy>", line, column) if part is not None)
        text = f"{where}: " + (f"{field}: " if field else "") + problem + (f" ({hint})" if hint else "")
        super().__init__(text)
        self.problem = problem
        self.file = file
        self.line = line
        self.column = column
        self.field = field
        self.hint = hint


class ToolBlockedError(ClefGuardError):
    """A tool call the guard stopped, raised where stopping means raising (callbacks).

    ``verdict`` is the :class:`clef_guard.Verdict` that stopped it.
    """

    def __init__(self, verdict: object, message: str) -> None:
        super().__init__(message)
        self.verdict = verdict


class ModelLoadError(ClefGuardError):
    """A backbone, adapter or decision head that cannot be loaded."""


class EngineError(ClefGuardError):
    """The engine failed while answering a request."""


class EngineTimeoutError(EngineError, TimeoutError):
    """The engine did not answer within the allowed time."""


class RemoteEngineError(EngineError):
    """A System One server failed, refused the call, or sent an answer that is not one.

    ``url`` is the route called and ``status`` the HTTP status of the response at fault
    (``None`` when no response came back).
    """

    def __init__(self, message: str, *, url: str, status: int | None = None) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
