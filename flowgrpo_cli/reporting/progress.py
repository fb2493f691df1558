"""Progress reporting that stages call and the CLI renders: stages never print themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rich.progress import Progress as Bar
    from rich.progress import TaskID


class Progress(Protocol):
    def start(self, description: str, total: int, unit: str = "images") -> None: ...

    def advance(self, amount: int = 1) -> None: ...

    def finish(self) -> None: ...


class NullProgress:
    """For library use and tests: reports nothing."""

    def start(self, description: str, total: int, unit: str = "images") -> None:
        pass

    def advance(self, amount: int = 1) -> None:
        pass

    def finish(self) -> None:
        pass


class RichProgress:
    """One rich progress bar per piece of work (`start` ... `finish`), with its rate."""

    def __init__(self) -> None:
        self._bar: Bar | None = None
        self._task: TaskID | None = None
        self._unit = ""

    def start(self, description: str, total: int, unit: str = "images") -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self.finish()
        self._unit = unit
        self._bar = Bar(
            TextColumn("[bold]{task.description:<24}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total, rate="")

    def advance(self, amount: int = 1) -> None:
        if self._bar is None or self._task is None:
            return
        self._bar.advance(self._task, amount)
        speed = self._bar.tasks[0].speed
        if speed:
            self._bar.update(self._task, rate=f"{speed:.2f} {self._unit}/s")

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
