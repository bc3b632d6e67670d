"""The `orbit` command line. Library code raises typed errors; only this module prints and exits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
err = Console(stderr=True)


@app.callback()
def _root() -> None:
    """Orbit: prepare a model, bring a cluster up, serve an OpenAI-compatible API."""


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@app.command()
def prepare(
    model: Annotated[Path, typer.Argument(help="A Hugging Face model directory or a .gguf file.")],
    out: Annotated[Path, typer.Option("--out", help="The package directory to write.")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size (ranks).")] = 1,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    max_seq_len: Annotated[
        int, typer.Option(help="Longest prompt + output; 0: min(model, 4096).")
    ] = 0,
    max_batch: Annotated[int, typer.Option(help="Most sequences in one step.")] = 64,
    page_size: Annotated[int, typer.Option(help="Tokens per KV page.")] = 16,
    max_step_tokens: Annotated[
        int, typer.Option(help="Per-step token budget (prefill chunk).")
    ] = 2048,
    force: Annotated[bool, typer.Option(help="Replace an existing package at --out.")] = False,
) -> None:
    """Turn a checkpoint into a TP-sharded package."""
    from prepare.build import PrepareOptions, prepare_package
    from prepare.source import SourceError
    from runtime.layout import ShardingError

    opts = PrepareOptions(
        tp=tp,
        dtype=dtype,
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        kv_page_size=page_size,
        max_step_tokens=max_step_tokens,
        force=force,
    )
    try:
        path = prepare_package(model, out, opts)
    except (SourceError, ShardingError, FileExistsError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written.", code=130)
    err.print(f"package written to {path}")


def main() -> None:
    app()
