"""Feedback during long data passes (tokenizer training, tokenizing), which otherwise print nothing for minutes."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator

from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

log = logging.getLogger("parallama")


class Progress:
    """Counts documents and `unit`s (tokens, chars) of one pass. On a terminal a live rich line; otherwise
    a log line every `every` seconds, so that log files show progress too. On success, one summary line."""

    def __init__(self, what: str, unit: str = "tokens", every: float = 30.0):
        self.what, self.unit, self.every = what, unit, every
        self.docs = self.count = 0
        self._bar: RichProgress | None = None

    def __enter__(self) -> Progress:
        self.start = self._last = time.perf_counter()
        if sys.stderr.isatty():
            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self._status(), total=None)
        return self

    def _status(self) -> str:
        return f"{self.what}: {self.docs:,} docs, {self.count:,} {self.unit}"

    def update(self, docs: int, count: int) -> None:
        self.docs, self.count = self.docs + docs, self.count + count
        if self._bar is not None:
            self._bar.update(self._task, description=self._status())
        elif (now := time.perf_counter()) - self._last >= self.every:
            self._last = now
            log.info(f"{self._status()} so far ({now - self.start:.0f} s)")

    def counted(self, texts: Iterable[str]) -> Iterator[str]:
        """Pass `texts` through, counting documents and characters (for consumers that tokenize themselves)."""
        for text in texts:
            self.update(1, len(text))
            yield text

    def __exit__(self, exc_type, *_) -> None:
        if self._bar is not None:
            self._bar.stop()
        if exc_type is None:
            seconds = time.perf_counter() - self.start
            log.info(
                f"{self._status()} in {seconds:.1f} s ({self.count / max(seconds, 1e-9):,.0f} {self.unit}/s)"
            )
