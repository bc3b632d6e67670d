"""The `orbit` command line. Library code raises typed errors; only this module prints and exits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Orbit: prepare a model, bring a cluster up, serve an OpenAI-compatible API.",
)
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
    sign: Annotated[
        Path | None, typer.Option(help="Ed25519 private key (orbit keygen) to sign the manifest.")
    ] = None,
) -> None:
    """Turn a checkpoint into a TP-sharded package."""
    from prepare.build import PrepareOptions, prepare_package
    from prepare.source import SourceError
    from runtime.layout import ShardingError
    from runtime.signing import SignatureError

    opts = PrepareOptions(
        tp=tp,
        dtype=dtype,
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        kv_page_size=page_size,
        max_step_tokens=max_step_tokens,
        force=force,
        sign_key=sign,
    )
    try:
        path = prepare_package(model, out, opts)
    except (SourceError, ShardingError, SignatureError, FileExistsError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written.", code=130)
    err.print(f"package written to {path}")


def main() -> None:
    app()


@app.command()
def keygen(
    key: Annotated[Path, typer.Argument(help="Where to write the private key; KEY.pub beside it.")],
) -> None:
    """Make an Ed25519 key pair for signing packages (orbit prepare --sign)."""
    from runtime.signing import SignatureError, generate_keypair

    try:
        public = generate_keypair(key)
    except SignatureError as e:
        fail(str(e))
    err.print(f"private key: {key} (keep it secret)\npublic key:  {public}")


@app.command()
def serve(
    package: Annotated[
        Path | None, typer.Argument(help="A package directory; omit to serve the default model.")
    ] = None,
    host: Annotated[str, typer.Option(help="Address the HTTP API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the HTTP API listens on.")] = 8000,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    kv_cache_mb: Annotated[int, typer.Option(help="KV cache per CPU rank, in MiB.")] = 512,
    kv_pages: Annotated[int, typer.Option(help="KV pages per rank; 0 sizes from memory.")] = 0,
    threads: Annotated[int, typer.Option(help="torch threads per CPU rank; 0: cores / ranks.")] = 0,
    model_name: Annotated[str, typer.Option(help="Name served at /v1/models.")] = "",
    api_key: Annotated[str | None, typer.Option(help="Require this Bearer key.")] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="Read the required Bearer key from this file.")
    ] = None,
    trusted_key: Annotated[
        list[Path] | None,
        typer.Option(help="Ed25519 public key; repeat for several. Given: refuse unsigned packages."),
    ] = None,
    drain_timeout: Annotated[float, typer.Option(help="Seconds running requests get on stop.")] = 30.0,
    cache_dir: Annotated[
        Path, typer.Option(help="Where the default model's package is kept.")
    ] = Path.home() / ".cache" / "orbit",
) -> None:
    """Serve a package on this machine: its ranks plus the OpenAI-compatible HTTP API."""
    import asyncio
    import logging

    from orbit.default_model import DefaultModelMissing, default_package
    from orbit.local_ranks import LocalRankOptions
    from orbit.serve import ServeOptions
    from orbit.serve import serve as run_serve
    from runtime.package import PackageError
    from runtime.signing import SignatureError

    if device not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda, not {device!r}.")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if package is None:
            err.print("preparing the default model (SmolLM2-135M-Instruct) if needed...")
            package = default_package(cache_dir, device)
    except DefaultModelMissing as e:
        fail(str(e))
    if api_key_file is not None:
        try:
            api_key = api_key_file.read_text().strip()
        except OSError as e:
            fail(f"cannot read --api-key-file {api_key_file}: {e.strerror}.")
        if not api_key:
            fail(f"--api-key-file {api_key_file} is empty.")
    opts = ServeOptions(
        package=package, host=host, port=port, model_name=model_name, api_key=api_key,
        drain_timeout_s=drain_timeout, trusted_keys=tuple(trusted_key or ()),
        ranks=LocalRankOptions(device=device, kv_pages=kv_pages, kv_cache_mb=kv_cache_mb,
                               threads=threads, trusted_keys=tuple(trusted_key or ())),
    )

    def on_ready(engine) -> None:
        err.print(f"serving {engine.model_name} on http://{host}:{port}/v1 "
                  f"({opts.package}, {engine.scheduler.config.num_pages} KV pages)")

    try:
        code = asyncio.run(run_serve(opts, on_ready=on_ready))
    except (PackageError, SignatureError) as e:
        fail(str(e))
    raise typer.Exit(code)
