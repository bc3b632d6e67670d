"""`orbit up`'s progress in a terminal: a bar per host for the push, a line per rank.

It draws the events orbit/cluster/up.py reports (UpEvents); importing it loads torch (through
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

from orbit.cluster.doctor import findings_table, fingerprint_table, summary_line
from orbit.cluster.preflight import PreflightReport
from orbit.cluster.push import PushResult
from orbit.cluster.up import UpEvents

# A rank's line counts these steps: the process started, each phase it reports, ready. CPU
# ranks skip graph capture, so their bar jumps one step there.
RANK_STEPS = {
    name: step
    for step, name in enumerate(
        ("starting", "connect", "join group", "load", "KV allocation", "graph capture",
         "collectives check", "ready"),
        start=1,
    )
}  # fmt: skip


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

    def preflight(self, report: PreflightReport) -> None:
        """The findings (and, when one is hard, every host's fingerprint), then a summary."""
        console = self.progress.console
        if report.hard:
            console.print(fingerprint_table(report))
        table = findings_table(report)
        if table is not None:
            console.print(table)
        interfaces = ", ".join(i or "not pinned" for i in report.interfaces)
        console.print(
            f"preflight: {summary_line(report)} Collectives interface per host: {interfaces}.",
            highlight=False,
        )

    def rank_state(self, rank: int, host_label: str, state: str, detail: str = "") -> None:
        if rank not in self.ranks:
            self.ranks[rank] = self.progress.add_task(
                f"rank {rank} on {host_label}", total=len(RANK_STEPS), status=state, push=False
            )
        status = f"{state} in {detail}" if detail else state
        self.progress.update(self.ranks[rank], completed=RANK_STEPS.get(state, 0), status=status)

    def note(self, text: str) -> None:
        self.progress.console.print(text, highlight=False)
