"""kvroute's exceptions (raised by the native module)."""

from __future__ import annotations

__all__ = ["SelectionServiceError", "InvalidRequestError"]


class SelectionServiceError(Exception):
    """A request the selection service refused, as the HTTP API would.

    ``str(e)`` is the HTTP ``error`` text for the same failure, ``status_code`` its HTTP status
    (400, 404, 409, 429, 503) and ``kind`` a category like Dynamo's: ``bad_request``,
    ``not_found``, ``conflict``, ``overloaded``, ``not_ready`` (no schedulable workers, shutting
    down) or ``scheduler`` (pinned/allowed workers unavailable).
    """

    status_code: int
    kind: str

    def __init__(self, message: str, status_code: int = 500, kind: str = "internal") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.kind = kind

    def __reduce__(self):  # keep the attributes through pickling (multiprocessing, Ray)
        return (type(self), (str(self), self.status_code, self.kind))


class InvalidRequestError(SelectionServiceError, ValueError):
    """A 400: the request is well-formed but invalid (no prompt, empty ``token_ids``, an id over
    1,024 bytes, ``effective_prefill_tokens`` above ``isl_tokens``, ``decay_fraction`` outside
    [0, 1], ...). Also a ``ValueError``, as Dynamo raises for the same failures."""


# Shown and pickled as kvroute.SelectionServiceError, where users import them from.
SelectionServiceError.__module__ = "kvroute"
InvalidRequestError.__module__ = "kvroute"
