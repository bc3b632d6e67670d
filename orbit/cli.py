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


def _print_version(asked: bool) -> None:
    """`orbit --version`: the release and the digest of the code that runs (as `orbit doctor`
    compares hosts), then exit."""
    if not asked:
        return
    from orbit.cluster.fingerprint_probe import code_digest
    from runtime.version import __version__

    print(f"orbit {__version__} (code {code_digest()[:12]})")
    raise typer.Exit(0)


@app.callback()
def _root(
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where cluster state records live (default ~/.cache/orbit/clusters)."),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version; exit."
        ),
    ] = False,
) -> None:
    """Orbit: prepare a model, bring a cluster up, serve an OpenAI-compatible API."""
    if state_dir is not None:
        from orbit.cluster.state import use_state_dir

        use_state_dir(state_dir)


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
    prefill_buckets: Annotated[
        str,
        typer.Option(
            help="Token buckets of the prompt-step CUDA graphs, comma-separated and ascending "
            "(a step pads to the smallest that holds it); default: powers of two from 16."
        ),
    ] = "",
    force: Annotated[bool, typer.Option(help="Replace an existing package at --out.")] = False,
    sign: Annotated[
        Path | None, typer.Option(help="Ed25519 private key (orbit keygen) to sign the manifest.")
    ] = None,
    quantize: Annotated[
        str | None,
        typer.Option(help="fp8: FP8 weights with per-row scales (an FP8 checkpoint stays FP8)."),
    ] = None,
    kv_dtype: Annotated[
        str | None,
        typer.Option(help="fp8: serve with FP8 KV pages by default (orbit serve --kv-dtype)."),
    ] = None,
) -> None:
    """Turn a checkpoint into a TP-sharded package."""
    _check_tp_fast(model, tp)
    if quantize not in (None, "fp8"):
        fail(f"--quantize {quantize!r} is not supported; pass --quantize fp8 or leave it out.")
    if kv_dtype not in (None, "fp8"):
        fail(f"--kv-dtype {kv_dtype!r} is not supported; pass --kv-dtype fp8 or leave it out.")
    buckets = _int_list("--prefill-buckets", prefill_buckets)
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
        prefill_buckets=buckets,
        force=force,
        sign_key=sign,
        quantize=quantize or "",
        kv_dtype=kv_dtype or "",
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


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    """A flag's comma-separated whole numbers; () for an empty one."""
    try:
        return tuple(int(x) for x in text.split(",")) if text.strip() else ()
    except ValueError:
        fail(f"{flag} {text!r} must be whole numbers separated by commas, such as 16,32,64.")


def _speculation(
    method: str, num_tokens: int, ngram_min: int, draft: Path | None, cluster: Path | None
):
    from runtime.speculation import SpeculationConfig

    if draft is not None and cluster is not None:
        fail(
            "--draft is for the ranks orbit serve starts; with --cluster the ranks hold the "
            "draft: pass it to orbit up --draft, and serve with --speculate draft alone."
        )
    if cluster is None and (method == "draft") != (draft is not None):
        fail(
            "--speculate draft and --draft PACKAGE go together: pass both, or neither "
            "(--speculate ngram needs no draft)."
        )
    _check_draft_path(draft)
    if ngram_min != 2 and method != "ngram":
        fail(f"--ngram-min is for --speculate ngram, not {method}; drop it or pass that.")
    if method == "off":
        return None
    try:
        return SpeculationConfig(
            method=method,
            num_tokens=num_tokens,
            ngram_min=ngram_min,
            ngram_max=max(SpeculationConfig.ngram_max, ngram_min),
        )
    except ValueError as e:
        fail(f"--speculate/--spec-tokens/--ngram-min: {e}.")


def _check_exact_verification(exact: bool, cluster: Path | None) -> None:
    # Alone (without --speculate) it is allowed: those ranks' output is what the same ranks
    # with speculation must equal, so it is the reference to compare them against.
    if exact and cluster is not None:
        fail(
            "--exact-verification is the ranks' setting and orbit up starts them: pass it to "
            "orbit up, and serve with --speculate alone."
        )


def _check_draft_path(draft: Path | None) -> None:
    if draft is not None and not (draft / "manifest.pb").is_file():
        fail(f"--draft {draft}: no Orbit package there; prepare one with orbit prepare --tp 1.")


_KV_DTYPE_HELP = (
    "KV pages: auto (the package's choice, its dtype unless prepared with --kv-dtype fp8), "
    "fp8 (e4m3, half the bytes: twice the pages) or model (the package's dtype)."
)
KV_DTYPES = ("auto", "fp8", "model")  # runtime/quant.py's, without importing torch
_EXACT_VERIFICATION_HELP = (
    "Speculative decoding on CUDA ranks: compute every row of a step of up to 32 as it is "
    "computed alone, so greedy output with --speculate is bit for bit these ranks' output "
    "without it (this flag alone); one-token steps then give up the one-row GEMV "
    "(docs/operations.md)."
)


def _check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        fail(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}; pick one of those.")


def _check_tp_fast(source: Path, tp: int) -> None:
    """A --tp that cannot split the model fails here, from its header, before weights are read."""
    from prepare.source_header import check_source_tp
    from runtime.layout import ShardingError

    try:
        check_source_tp(source, tp)
    except ShardingError as e:
        fail(str(e))


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
        Path | None,
        typer.Argument(
            help="A package, a Hugging Face model directory or a .gguf file (prepared into "
            "--cache-dir once); omit to serve the default model."
        ),
    ] = None,
    cluster: Annotated[
        Path | None,
        typer.Option(help="cluster.toml of ranks started by `orbit up`: serve them, start none."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address the HTTP API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the HTTP API listens on.")] = 8000,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    kv_cache_mb: Annotated[int, typer.Option(help="KV cache per CPU rank, in MiB.")] = 512,
    kv_pages: Annotated[int, typer.Option(help="KV pages per rank; 0 sizes from memory.")] = 0,
    kv_dtype: Annotated[str, typer.Option(help=_KV_DTYPE_HELP)] = "auto",
    max_queue: Annotated[int, typer.Option(help="Queued requests beyond this get 429.")] = 1024,
    stream_interval: Annotated[
        int,
        typer.Option(
            help="Stream each response's tokens in groups of this many (the first and last at "
            "once): less CPU per token at many streams, coarser streaming."
        ),
    ] = 1,
    prefix_cache: Annotated[
        bool,
        typer.Option(help="Reuse the KV of prompt prefixes that earlier requests computed."),
    ] = True,
    speculate: Annotated[
        str,
        typer.Option(
            help="Speculative decoding: off, ngram (propose what followed the sequence's "
            "latest suffix earlier in its prompt and output) or draft (a smaller model: --draft)."
        ),
    ] = "off",
    draft: Annotated[
        Path | None,
        typer.Option(
            help="With --speculate draft: a package of a smaller model with the same tokenizer, "
            "prepared with --tp 1 and the served package's --page-size; rank 0 runs it."
        ),
    ] = None,
    spec_tokens: Annotated[
        int, typer.Option(help="Speculative decoding: the most proposals per step, 1 to 16.")
    ] = 4,
    ngram_min: Annotated[
        int,
        typer.Option(
            help="--speculate ngram: the shortest suffix a proposal matches (longer are surer; "
            "3 suits copying long passages)."
        ),
    ] = 2,
    exact_verification: Annotated[bool, typer.Option(help=_EXACT_VERIFICATION_HELP)] = False,
    threads: Annotated[
        int, typer.Option(help="torch threads per CPU rank; 0: (cores - 1) / ranks, at least 1.")
    ] = 0,
    model_name: Annotated[
        str,
        typer.Option(
            help="Served model id; several comma-separated are aliases, the first is listed. "
            "Default: the source name without .gguf and quantization tag."
        ),
    ] = "",
    log_level: Annotated[
        str, typer.Option(help="debug, info (one line per request), warning or error.")
    ] = "warning",
    chat_template: Annotated[
        Path | None, typer.Option(help="A Jinja chat template file replacing the package's.")
    ] = None,
    max_model_len: Annotated[
        int, typer.Option(help="Context length (prompt + output); 0: the package's.")
    ] = 0,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require this Bearer key (visible in ps; prefer the two below)."),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="Read the required Bearer key from this file.")
    ] = None,
    api_key_env: Annotated[
        str | None,
        typer.Option(help="Read the required Bearer key from this environment variable."),
    ] = None,
    trusted_key: Annotated[
        list[Path] | None,
        typer.Option(
            help="Ed25519 public key; repeat for several. Given: refuse unsigned packages."
        ),
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option(help="Seconds running requests get on stop.")
    ] = 30.0,
    api_servers: Annotated[
        int,
        typer.Option(
            help="HTTP API server processes; 0: 1 with --device cpu, else one per four cores, "
            "1 to 4."
        ),
    ] = 0,
    cache_dir: Annotated[
        Path, typer.Option(help="Where packages prepared from checkpoints are kept.")
    ] = Path.home() / ".cache" / "orbit",
    tp: Annotated[int | None, typer.Option(help="Checkpoint: TP size to prepare (1).")] = None,
    dtype: Annotated[str | None, typer.Option(help="Checkpoint: dtype, as prepare.")] = None,
    max_seq_len: Annotated[int | None, typer.Option(help="Checkpoint: as prepare.")] = None,
    max_batch: Annotated[int | None, typer.Option(help="Checkpoint: as prepare.")] = None,
    page_size: Annotated[int | None, typer.Option(help="Checkpoint: as prepare.")] = None,
    max_step_tokens: Annotated[int | None, typer.Option(help="Checkpoint: as prepare.")] = None,
    quantize: Annotated[
        str | None, typer.Option(help="Checkpoint: fp8 weights, as prepare --quantize.")
    ] = None,
) -> None:
    """Serve a package on this machine: its ranks plus the OpenAI-compatible HTTP API."""
    from orbit.serve_source import PrepareFlags

    if quantize not in (None, "fp8"):
        fail(f"--quantize {quantize!r} is not supported; pass --quantize fp8 or leave it out.")
    _check_kv_dtype(kv_dtype)
    flags = PrepareFlags(tp, dtype, max_seq_len, max_batch, page_size, max_step_tokens, quantize)
    if cluster is not None and flags.given():
        fail(
            "--tp, --dtype, --quantize and the capacities come from cluster.toml's package; "
            "drop them."
        )
    import logging

    from orbit.core.listen import ListenError
    from orbit.model_names import ModelNameError
    from orbit.serve_checks import EarlyChecks, ServeArgError, early_checks

    api_key = _api_key(api_key, api_key_file, api_key_env)
    if stream_interval < 1:
        fail(f"--stream-interval must be 1 or more, not {stream_interval}.")
    speculation = _speculation(speculate, spec_tokens, ngram_min, draft, cluster)
    _check_exact_verification(exact_verification, cluster)
    try:  # mistakes found in seconds, before anything heavy is imported or loaded
        checks = EarlyChecks(package, device, host, port, log_level, model_name, max_model_len)
        log_level, template = early_checks(checks, chat_template, local=cluster is None)
    except (ServeArgError, ModelNameError, ListenError) as e:
        fail(str(e))
    if cluster is None:  # after the checks above: preparing a checkpoint can take minutes
        package = _served_package(package, cache_dir, flags)

    import uvloop

    from orbit.core.local_ranks import LocalRankOptions
    from orbit.serve import ServeError, ServeOptions
    from orbit.serve import serve as run_serve
    from runtime.package import PackageError
    from runtime.signing import SignatureError

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if cluster is not None:
        package = _cluster_package(package, cluster)
    opts = ServeOptions(
        package=package,
        host=host,
        port=port,
        model_name=model_name,
        api_key=api_key,
        drain_timeout_s=drain_timeout,
        trusted_keys=tuple(trusted_key or ()),
        max_queue=max_queue,
        stream_interval=stream_interval,
        prefix_cache=prefix_cache,
        speculation=speculation,
        cluster=cluster,
        api_servers=api_servers,
        log_level=log_level,
        chat_template=template,
        max_model_len=max_model_len,
        ranks=LocalRankOptions(
            log_level=log_level,
            device=device,
            kv_pages=kv_pages,
            kv_cache_mb=kv_cache_mb,
            kv_dtype=kv_dtype,
            threads=threads,
            trusted_keys=tuple(trusted_key or ()),
            draft_package=draft,
            exact_verification=exact_verification,
        ),
    )

    def on_ready(engine) -> None:
        pages = f"{engine.scheduler.config.num_pages} KV pages"
        if engine.link.kv_dtype:
            pages += f" of {engine.link.kv_dtype}"
        err.print(f"serving on http://{host}:{port}/v1 ({opts.package}, {pages})")

    if api_servers < 0:
        fail(f"--api-servers must be 0 (automatic) or more, not {api_servers}.")
    try:
        code = uvloop.run(run_serve(opts, on_ready=on_ready))
    except (PackageError, SignatureError, ServeError) as e:
        fail(str(e))
    except ListenError as e:
        fail(str(e))
    except _cluster_errors(cluster) as e:
        fail(_message(e))
    raise typer.Exit(code)


def _say(line: str) -> None:
    err.print(line, highlight=False, soft_wrap=True)


def _served_package(package: Path | None, cache_dir: Path, flags) -> Path:
    """orbit/serve_source.py: PACKAGE itself, or the package prepared from a checkpoint (or the
    default model) in the cache; a wrong --tp fails from the header, before torch is imported."""
    from orbit.default_model import DefaultModelMissing
    from orbit.serve_source import ServeSourceError, served_package
    from runtime.layout import ShardingError

    try:
        return served_package(package, cache_dir, flags, _say)
    except (DefaultModelMissing, ServeSourceError, ShardingError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; the cache holds nothing half-written.", code=130)
    except RuntimeError as e:
        from prepare.cache import PrepareFailed  # imported late: it imports torch

        if not isinstance(e, PrepareFailed):
            raise
        fail(str(e))
    except ValueError as e:
        from prepare.source import SourceError  # imported late: it imports torch

        if not isinstance(e, SourceError):
            raise
        fail(str(e))


def _cluster_errors(cluster: Path | None) -> tuple[type[Exception], ...]:
    """What `serve --cluster` may raise; without --cluster, nothing of orbit/cluster/ (nor
    asyncssh) is imported."""
    if cluster is None:
        return ()
    from orbit.cluster.config import ClusterConfigError
    from orbit.cluster.ssh import ClusterError

    return ClusterError, ClusterConfigError


def _api_key(key: str | None, key_file: Path | None, key_env: str | None) -> str | None:
    """The Bearer key from at most one of --api-key, --api-key-file, --api-key-env."""
    import os

    options = {"--api-key": key, "--api-key-file": key_file, "--api-key-env": key_env}
    given = [name for name, value in options.items() if value is not None]
    if len(given) > 1:
        fail(f"give only one of {', '.join(options)}, not {' and '.join(given)}.")
    if key is not None:
        err.print(
            "[yellow]warning:[/] --api-key is visible to other local users (ps, /proc); "
            "use --api-key-file or --api-key-env instead.",
            highlight=False,
        )
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as e:
            fail(f"cannot read --api-key-file {key_file}: {e.strerror}.")
        if not key:
            fail(f"--api-key-file {key_file} is empty.")
    if key_env is not None:
        key = os.environ.get(key_env, "").strip()
        if not key:
            fail(f"--api-key-env {key_env}: that environment variable is unset or empty.")
    if key == "":
        fail("--api-key is empty.")
    return key


# ---- cluster commands: orbit/cluster/up.py, cluster_ops.py, cluster_display.py ---------------

ClusterFile = Annotated[Path, typer.Argument(help="The cluster.toml file (docs/cluster.md).")]


def _message(e: BaseException) -> str:
    """The error and its notes (bring-up notes what it stopped after a failure), escaped for
    rich: log tails hold brackets that are not markup."""
    from rich.markup import escape

    return escape("\n".join([str(e), *getattr(e, "__notes__", [])]))


def _run_cluster(make_coro, ctrl_c_ends: bool = False, live=None):
    """asyncio.run the library call; typed errors become one message and exit status 1. With
    ctrl_c_ends, Ctrl-C is the normal way out (logs --follow) and exits 0. `live` (a progress
    display) is closed before the message, so the message is the last thing printed."""
    import asyncio
    import contextlib
    import logging

    from orbit.cluster.config import ClusterConfigError
    from orbit.cluster.ssh import ClusterError
    from runtime.curve import CurveError
    from runtime.package import PackageError

    # Every failure asyncssh logs also reaches us as an exception, which says it in one line;
    # its own log records (with tracebacks) would bury that line.
    logging.getLogger("asyncssh").setLevel(logging.CRITICAL)
    try:
        with live or contextlib.nullcontext():
            return asyncio.run(make_coro())
    except (ClusterError, ClusterConfigError, CurveError, PackageError) as e:
        fail(_message(e))
    except KeyboardInterrupt:
        if ctrl_c_ends:
            return None
        fail("interrupted; whatever this command had started was stopped.", code=130)


def _rank_log_level(level: str) -> str:
    from orbit.serve_checks import ServeArgError, check_log_level

    try:
        return check_log_level(level)
    except ServeArgError as e:
        fail(str(e))


def _cluster_package(package: Path | None, cluster: Path) -> Path:
    from orbit.cluster.config import ClusterConfigError, load_cluster_config

    try:
        configured = load_cluster_config(cluster).package
    except ClusterConfigError as e:
        fail(str(e))
    if package is not None and package.absolute() != configured.absolute():
        fail(f"--cluster serves {configured} (from {cluster}), not {package}; drop PACKAGE.")
    return configured


@app.command()
def up(
    cluster_toml: ClusterFile,
    accept_new_host_keys: Annotated[
        bool, typer.Option(help="Trust and record host keys not yet in known_hosts.")
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds for connecting and for every rank to become ready.")
    ] = 600.0,
    kv_pages: Annotated[int, typer.Option(help="KV pages per rank; 0 sizes from memory.")] = 0,
    kv_cache_mb: Annotated[int, typer.Option(help="KV cache per CPU rank, in MiB.")] = 512,
    kv_dtype: Annotated[str, typer.Option(help=_KV_DTYPE_HELP)] = "auto",
    force: Annotated[
        bool, typer.Option(help="Start even if the preflight finds hard problems.")
    ] = False,
    join_timeout: Annotated[
        float,
        typer.Option(help="Seconds a rank may take to join the TP group before it gives up."),
    ] = 120.0,
    log_level: Annotated[
        str, typer.Option(help="The ranks' log level: debug, info, warning or error.")
    ] = "warning",
    draft: Annotated[
        Path | None,
        typer.Option(
            help="A draft package for speculative decoding (orbit serve --cluster ... "
            "--speculate draft): pushed to rank 0's host, which runs it."
        ),
    ] = None,
    exact_verification: Annotated[bool, typer.Option(help=_EXACT_VERIFICATION_HELP)] = False,
) -> None:
    """Check the hosts (as `orbit doctor`), push the package, start the ranks, wait until all
    are ready."""
    from orbit.cluster.progress import RichUpEvents
    from orbit.cluster.up import UpOptions
    from orbit.cluster.up import up as run_up

    _check_kv_dtype(kv_dtype)
    _check_draft_path(draft)
    opts = UpOptions(
        accept_new_host_keys=accept_new_host_keys,
        timeout_s=timeout,
        kv_pages=kv_pages,
        kv_cache_mb=kv_cache_mb,
        kv_dtype=kv_dtype,
        force=force,
        join_timeout_s=join_timeout,
        log_level=_rank_log_level(log_level),
        draft_package=draft,
        exact_verification=exact_verification,
    )
    events = RichUpEvents(err)
    result = _run_cluster(lambda: run_up(cluster_toml, opts, events), live=events)
    state = result.state
    what = "already up" if result.already_running else "up"
    err.print(
        f"{what}: {state.tp_size} ranks of package {state.package_digest[:12]} on "
        f"{len(state.hosts)} hosts, frontend {state.frontend_endpoint}; serve them with "
        f"`orbit serve --cluster {cluster_toml}`.",
        highlight=False,
    )


@app.command()
def status(
    cluster_toml: Annotated[
        Path | None, typer.Argument(help="A cluster.toml; omit to show every recorded cluster.")
    ] = None,
) -> None:
    """Show every rank: host, pid, alive, package, uptime, log. Exit 1 unless all are alive."""
    from orbit.cluster.display import status_table
    from orbit.cluster.ops import require_state, state_status
    from orbit.cluster.state import ClusterStateError, all_states

    try:
        states = [require_state(cluster_toml)] if cluster_toml else all_states()
    except ClusterStateError as e:
        fail(_message(e))
    if not states:
        err.print("no cluster is recorded; `orbit up cluster.toml` brings one up.")
        return
    out = Console()
    healthy = True
    for state in states:
        statuses = _run_cluster(lambda state=state: state_status(state))
        out.print(status_table(state, statuses))
        healthy = healthy and all(s.alive for s in statuses)
    raise typer.Exit(0 if healthy else 1)


@app.command()
def logs(
    cluster_toml: ClusterFile,
    rank: Annotated[int | None, typer.Option(help="Only this rank's log.")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")
    ] = False,
    lines: Annotated[int, typer.Option(help="How many of the last lines to print.")] = 50,
) -> None:
    """Print the ranks' logs, read over SSH."""
    from orbit.cluster.ops import cluster_logs, follow_cluster_logs

    if follow:

        async def follow_all() -> None:
            async for r, line in follow_cluster_logs(cluster_toml, rank, lines):
                print(line if rank is not None else f"[rank {r}] {line}", flush=True)

        _run_cluster(follow_all, ctrl_c_ends=True)
        return
    for record, host, text in _run_cluster(lambda: cluster_logs(cluster_toml, rank, lines)):
        if rank is None:
            print(f"==> rank {record.rank} on {host.label}: {record.log_file} <==")
        print(text)


@app.command()
def down(
    cluster_toml: ClusterFile,
    grace: Annotated[
        float, typer.Option(help="Seconds ranks get after SIGTERM before SIGKILL.")
    ] = 10.0,
) -> None:
    """Stop every rank `orbit up` started for cluster.toml and forget the cluster."""
    from orbit.cluster.ops import cluster_down

    state = _run_cluster(lambda: cluster_down(cluster_toml, grace))
    if state is None:
        err.print(f"nothing to stop: no cluster is recorded for {cluster_toml}.", highlight=False)
        return
    err.print(f"down: stopped {state.tp_size} ranks on {len(state.hosts)} hosts.", highlight=False)


# ---- orbit doctor: orbit/cluster/doctor.py (checks in orbit/cluster/checks.py, orbit/cluster/preflight.py) ----------


@app.command()
def doctor(
    cluster_toml: ClusterFile,
    accept_new_host_keys: Annotated[
        bool, typer.Option(help="Trust and record host keys not yet in known_hosts.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds for each host's fingerprint.")] = 60.0,
) -> None:
    """Check every host of cluster.toml as `orbit up` would, without starting anything: versions,
    GPUs, package, disk, clocks, network interfaces, ports. Exit 1 on a hard problem."""
    from orbit.cluster.doctor import (
        DoctorOptions,
        findings_table,
        fingerprint_table,
        routes_table,
        summary_line,
    )
    from orbit.cluster.doctor import doctor as run_doctor

    opts = DoctorOptions(accept_new_host_keys=accept_new_host_keys, probe_timeout_s=timeout)
    report = _run_cluster(lambda: run_doctor(cluster_toml, opts))
    out = Console()
    for table in (fingerprint_table(report), routes_table(report), findings_table(report)):
        if table is not None:
            out.print(table)
    out.print(summary_line(report), highlight=False)
    raise typer.Exit(1 if report.hard else 0)
