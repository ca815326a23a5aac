"""The `blunb` logger for one run: the console on every rank, log.txt on rank 0."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from blunb.runs import check_write, write_failed


class RunFileHandler(logging.FileHandler):
    """log.txt. A record it cannot write (a full disk) stops the run with RunWriteError naming the
    file, where logging's default prints '--- Logging error ---' and drops the line; after that it
    writes nothing (the run is stopping for that error; the console still shows every line)."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        try:
            check_write(Path(self.baseFilename))
        except OSError as err:
            self.failed = True
            raise write_failed(Path(self.baseFilename), err) from err
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            return super().handleError(record)
        self.failed = True
        raise write_failed(Path(self.baseFilename), err) from err


class RunLog:
    """The `blunb` logger for one run: rank 0 writes to stdout and log.txt; other ranks show
    warnings and errors only, prefixed with their rank. close() restores the logger."""

    def __init__(self, rank: int):
        self.rank = rank
        self.logger = logging.getLogger("blunb")
        self._saved = (self.logger.level, self.logger.propagate)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False  # a notebook's or pytest's root handler would print it twice
        self._handlers: list[logging.Handler] = []
        self._add(logging.StreamHandler(sys.stdout), logging.INFO if rank == 0 else logging.WARNING)

    def _add(self, handler: logging.Handler, level: int) -> None:
        handler.setLevel(level)
        handler.setFormatter(logging.Formatter("%(message)s" if self.rank == 0 else f"[rank {self.rank}] %(message)s"))
        self.logger.addHandler(handler)
        self._handlers.append(handler)

    def to_file(self, path: Path) -> None:
        if self.rank == 0:
            self._add(RunFileHandler(path, mode="a"), logging.INFO)

    def close(self) -> None:
        for h in self._handlers:
            self.logger.removeHandler(h)
            h.close()
        self.logger.setLevel(self._saved[0])
        self.logger.propagate = self._saved[1]
