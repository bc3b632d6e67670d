"""`orbit up`'s progress in a terminal: a bar per host for the push, a line per rank.

It draws the events orbit/cluster_up.py reports (UpEvents); importing it loads torch (through
cluster_up), so only `orbit up` does.
"""

from __future__ import annotations

from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from orbit.cluster_up import UpEvents
from orbit.push import PushResult

RANK_STEPS = {"starting": 1, "loading": 2, "ready": 3}  # out of 3: started, connected, ready


class _BytesColumn(DownloadColumn):
    """Bytes for the push bars only; the rank lines count steps, not bytes."""

    def render(self, task) -> Text:
        return super().render(task) if task.fields.get("push") else Text("")


class _SpeedColumn(TransferSpeedColumn):
    def render(self, task) -> Text:
        return super().render(task) if task.fields.get("push") else Text("")


class RichUpEvents(UpEvents):
    """One bar per host for the push, then one line per rank until it is ready."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            _BytesColumn(),
            _SpeedColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.hosts: dict[int, TaskID] = {}
        self.ranks: dict[int, TaskID] = {}

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def push_started(self, host_index: int, host_label: str) -> None:
        self.hosts[host_index] = self.progress.add_task(
            f"push {host_label}", total=None, status="verifying the store", push=True
        )

    def push_progress(self, host_index: int, done_bytes: int, total_bytes: int) -> None:
        self.progress.update(
            self.hosts[host_index], completed=done_bytes, total=total_bytes, status="pushing"
        )

    def pushed(self, host_index: int, result: PushResult) -> None:
        status = f"{result.files_uploaded} sent, {result.files_skipped} already there"
        self.progress.update(self.hosts[host_index], status=status)

    def rank_state(self, rank: int, host_label: str, state: str) -> None:
        if rank not in self.ranks:
            self.ranks[rank] = self.progress.add_task(
                f"rank {rank} on {host_label}", total=len(RANK_STEPS), status=state, push=False
            )
        self.progress.update(self.ranks[rank], completed=RANK_STEPS[state], status=state)

    def note(self, text: str) -> None:
        self.progress.console.print(text, highlight=False)
