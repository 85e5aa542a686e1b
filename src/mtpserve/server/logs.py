"""Logs as a llama-server user reads them: `M.SS.mmm.uuu L message` on stderr (minutes, seconds,
milliseconds and microseconds since start; L = I/W/E/D), the server's lines carrying llama-server's
`srv  function:` / `slot function: id N | task T |` tags in their text.

Verbosity follows `-lv N` (llama.cpp): 1 errors, 2 + warnings, 3 + information (default), 4 + debug.
`--log-file F` writes the same lines to F as well; `--log-format json` writes one JSON object per line
instead (`t` seconds since start, `level`, `logger`, `message`), for log collectors.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LEVEL_LETTER = {logging.DEBUG: "D", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "E"}
VERBOSITY_LEVEL = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG}


class LlamaFormatter(logging.Formatter):
    def __init__(self, start: float, prefix: bool = True, timestamps: bool = True) -> None:
        super().__init__()
        self.start, self.prefix, self.timestamps = start, prefix, timestamps

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if not self.prefix:
            return message
        head = LEVEL_LETTER.get(record.levelno, "I")
        if self.timestamps:
            us = int((record.created - self.start) * 1e6)
            minutes, us = divmod(us, 60_000_000)
            seconds, us = divmod(us, 1_000_000)
            ms, us = divmod(us, 1000)
            head = f"{minutes}.{seconds:02d}.{ms:03d}.{us:03d} {head}"
        return f"{head} {message}"


class JSONFormatter(logging.Formatter):
    def __init__(self, start: float) -> None:
        super().__init__()
        self.start = start

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "t": round(record.created - self.start, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(
    verbosity: int = 3,
    log_file: str | None = None,
    prefix: bool = True,
    timestamps: bool = True,
    json_lines: bool = False,
) -> None:
    """Route `mtpserve.*` loggers (and uvicorn's errors) through llama-server's format (or JSON lines)."""
    start = time.time()
    formatter = JSONFormatter(start) if json_lines else LlamaFormatter(start, prefix, timestamps)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    level = VERBOSITY_LEVEL.get(max(0, min(verbosity, 4)), logging.INFO)
    root.setLevel(level)
    logging.getLogger("uvicorn.access").setLevel(logging.DEBUG if verbosity >= 4 else logging.WARNING)
    logging.getLogger("uvicorn.error").setLevel(max(level, logging.WARNING))
