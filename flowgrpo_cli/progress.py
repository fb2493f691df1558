"""Progress reporting that stages call and the CLI renders: stages never print themselves."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, description: str, total: int) -> None: ...

    def advance(self, amount: int = 1) -> None: ...

    def finish(self) -> None: ...


class NullProgress:
    """For library use and tests: reports nothing."""

    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int = 1) -> None:
        pass

    def finish(self) -> None:
        pass


class RichProgress:
    """A rich progress bar with items per second, one task per `start`."""

    def __init__(self, unit: str = "images"):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self.unit = unit
        self._bar = Bar(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task = None

    def start(self, description: str, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task(description, total=total, rate="")

    def advance(self, amount: int = 1) -> None:
        self._bar.advance(self._task, amount)
        task = self._bar.tasks[-1]
        if task.speed:
            self._bar.update(self._task, rate=f"{task.speed:.2f} {self.unit}/s")

    def finish(self) -> None:
        self._bar.stop()
