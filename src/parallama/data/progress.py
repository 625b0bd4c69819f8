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
    a log line every `every` seconds, so that log files show progress too. On success, one summary line.

    With `total` (documents expected, when the source knows it) the lines also give the share done and an
    ETA. Documents found already done (`reused`, e.g. a resumed build) count towards the share but not towards
    the rate, so the ETA is that of the work left."""

    def __init__(self, what: str, unit: str = "tokens", every: float = 30.0, total: int | None = None):
        self.what, self.unit, self.every, self.total = what, unit, every, total
        self.docs = self.count = self.reused_docs = 0
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

    def _rate(self, seconds: float) -> str:
        """The rate, and the share done and ETA when the total is known."""
        text = f"{self.count / max(seconds, 1e-9):,.0f} {self.unit}/s"
        if self.total:
            done = min(self.docs + self.reused_docs, self.total)
            text += f", {done / self.total:.0%}"
            if self.docs:
                left = round((self.total - done) * seconds / self.docs)
                text += f", ETA {left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}"
        return text

    def update(self, docs: int, count: int) -> None:
        self.docs, self.count = self.docs + docs, self.count + count
        self._show()

    def reused(self, docs: int) -> None:
        """`docs` documents that need no work (already in a finished part)."""
        self.reused_docs += docs
        self._show()

    def _show(self) -> None:
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self._status()}, {self._rate(now - self.start)}")
        elif now - self._last >= self.every:
            self._last = now
            log.info(f"{self._status()} so far ({now - self.start:.0f} s, {self._rate(now - self.start)})")

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
