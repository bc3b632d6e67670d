"""How `orbit status` looks in a terminal: one table row per rank.

Kept apart from the library (which returns data) and from cli.py (which parses arguments and
maps errors to exit codes). Light on imports: status, logs and down never load torch.
"""

from __future__ import annotations

import time

from rich.table import Table

from orbit.cluster.ops import RankStatus
from orbit.cluster.state import ClusterState


def uptime_text(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    days, rest = divmod(seconds, 86400)
    return (f"{days}d " if days else "") + time.strftime("%H:%M:%S", time.gmtime(rest))


def status_table(state: ClusterState, statuses: list[RankStatus]) -> Table:
    table = Table(
        title=f"{state.config_path}  package {state.package_digest[:12]}  "
        f"frontend {state.frontend_endpoint}",
        title_justify="left",
    )
    for column in ("host", "rank", "pid", "alive", "package", "uptime", "log"):
        table.add_column(column, no_wrap=column != "log")
    for s in statuses:
        alive = "[green]yes[/]" if s.alive else "[red]no[/]"
        if not s.reachable:
            alive = "[yellow]unreachable[/]"
        table.add_row(
            s.host.label,
            str(s.rank.rank),
            str(s.rank.pid),
            alive,
            state.package_digest[:12],
            uptime_text(s.uptime_s),
            s.rank.log_file,
        )
    return table
