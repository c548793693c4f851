"""How the HTTP door logs the requests it refuses, so that careless or hostile clients cannot flood it.

A refusal the client caused (4xx) is logged once, on one line, without a traceback: at WARNING for
401 (a wrong or missing token is worth an operator's look), else at INFO. Each status is a kind
that gets at most `per_second` lines a second; the lines past that are counted, and the next line
of that kind says how many were left out. Only a 500 (a bug here) carries a traceback; other 5xx
(verifier down, …) are WARNING lines. Client text (paths, messages) is cut short and quoted, so
it can neither bloat the log nor forge lines in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

LINES_PER_SECOND = 5  # per status: 1,000 bad requests a second still write about 5 lines
MAX_LOGGED_CHARS = 200  # of a path or a message


@dataclass
class _Window:
    start: float
    lines: int = 0
    suppressed: int = 0


class RefusalLog:
    """Rate-limited, one-line logging of refused requests (see the module docstring)."""

    def __init__(self, logger: logging.Logger = log, per_second: int = LINES_PER_SECOND,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.per_second = per_second
        self.clock = clock
        self._windows: dict[int, _Window] = {}

    def record(self, status: int, method: str, path: str, message: str,
               exc: BaseException | None = None) -> bool:
        """Log one refusal unless its kind is over its rate; True when a line was written."""
        now = self.clock()
        window = self._windows.get(status)
        if window is None or now - window.start >= 1.0:
            window = self._windows[status] = _Window(now, suppressed=window.suppressed if window else 0)
        if window.lines >= self.per_second:
            window.suppressed += 1
            return False
        window.lines += 1
        suppressed, window.suppressed = window.suppressed, 0
        level = (logging.ERROR if status == 500 else logging.WARNING if status >= 500 or status == 401
                 else logging.INFO)
        note = f" ({suppressed} more {status} refusals not logged)" if suppressed else ""
        self.logger.log(level, "HTTP %d %s %s: %s%s", status, method[:16], _short(path),
                        _short(message), note, exc_info=exc if status == 500 else None)
        return True


def _short(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """Client text for a log line: at most `limit` characters, quoted (no raw newlines or escapes)."""
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "…")


REFUSALS = RefusalLog()  # the process's one log of refusals, shared by the app and the body limit
