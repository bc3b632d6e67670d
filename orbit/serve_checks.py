"""`orbit serve`'s settings checked before anything heavy starts: each mistake is one
ServeArgError sentence with its fix, seconds before a package would load or a rank start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOG_LEVELS = ("debug", "info", "warning", "error")


class ServeArgError(ValueError):
    """A command-line setting of `orbit serve` that cannot work."""


def check_log_level(level: str) -> str:
    if level.lower() not in LOG_LEVELS:
        raise ServeArgError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {level!r}.")
    return level.lower()


def check_package_path(package: Path | None) -> None:
    """A PACKAGE argument that names nothing (a typo) is said so, not "not an Orbit package"."""
    if package is not None and not package.exists():
        raise ServeArgError(
            f"{package} does not exist; check the path, or omit PACKAGE to serve the default model."
        )


def check_device(device: str) -> None:
    """--device cuda needs a torch that sees a GPU here (only local ranks use --device)."""
    if device not in ("cpu", "cuda"):
        raise ServeArgError(f"--device must be cpu or cuda, not {device!r}.")
    if device == "cpu":
        return
    version = _torch_version_module()
    if version is not None and getattr(version, "cuda", None) is None:
        why = f"this torch ({getattr(version, '__version__', '?')}) was built without CUDA"
        raise ServeArgError(f"--device cuda: {why}; use --device cpu, or install a CUDA torch.")
    import torch  # a CUDA build: only torch itself can tell whether a GPU is usable

    if not torch.cuda.is_available():
        raise ServeArgError(
            "--device cuda: torch finds no usable CUDA GPU (check the driver and "
            "CUDA_VISIBLE_DEVICES); use --device cpu, or fix the GPU setup."
        )


def _torch_version_module():
    """torch/version.py (how torch was built), read without importing torch, which takes
    seconds; None when it cannot be found."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "version.py"
        if path.is_file():
            version_spec = importlib.util.spec_from_file_location("_orbit_torch_version", path)
            module = importlib.util.module_from_spec(version_spec)
            version_spec.loader.exec_module(module)
            return module
    return None


def check_max_model_len(package: Path | None, max_model_len: int) -> None:
    """--max-model-len against the package's max_seq_len, from its manifest alone (the default
    model's package, not prepared yet, is checked when it opens)."""
    if max_model_len < 0:
        raise ServeArgError(
            f"--max-model-len must be 0 (the package's) or more, not {max_model_len}."
        )
    manifest_path = package / "manifest.pb" if package is not None else None
    if max_model_len == 0 or manifest_path is None or not manifest_path.is_file():
        return
    from proto import package_pb2

    manifest = package_pb2.Manifest()
    try:
        manifest.ParseFromString(manifest_path.read_bytes())
    except Exception:  # noqa: BLE001 - a damaged manifest is reported when the package opens
        return
    package_max = manifest.capacities.max_seq_len
    if not 2 <= max_model_len <= package_max:
        raise ServeArgError(max_model_len_message(max_model_len, package_max, package))


def max_model_len_message(max_model_len: int, package_max: int, package: Path) -> str:
    return (
        f"--max-model-len {max_model_len} must be between 2 and the package's max_seq_len "
        f"({package_max}, {package}); re-prepare with `orbit prepare --max-seq-len` for a longer "
        "context."
    )


def read_chat_template(path: Path | None) -> str | None:
    """The text of --chat-template FILE, checked to be a Jinja template."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ServeArgError(f"cannot read --chat-template {path}: {reason}.") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ServeArgError(
            f"--chat-template {path} is not a valid Jinja template (line {e.lineno}: "
            f"{e.message}); fix the file."
        ) from None
    if not text.strip():
        raise ServeArgError(f"--chat-template {path} is empty; give a Jinja chat template.")
    return text


@dataclass(frozen=True)
class EarlyChecks:
    """The flags of `orbit serve` that can be checked before anything heavy loads."""

    package: Path | None
    device: str
    host: str
    port: int
    log_level: str
    model_name: str
    max_model_len: int


def early_checks(
    flags: EarlyChecks, chat_template: Path | None, local: bool = True
) -> tuple[str, str | None]:
    """Every check above, in the order a user would fix them; returns the log level and the
    chat template's text. Raises ServeArgError, ModelNameError or ListenError. `local`: ranks
    start here (not `--cluster`), so --device matters."""
    from orbit.core.listen import bind_http
    from orbit.model_names import served_model_ids

    level = check_log_level(flags.log_level)
    served_model_ids(flags.model_name, "unused")  # raises ModelNameError for a malformed flag
    check_package_path(flags.package)
    check_max_model_len(flags.package, flags.max_model_len)
    template = read_chat_template(chat_template)
    if local or flags.device not in ("cpu", "cuda"):
        check_device(flags.device)
    bind_http(flags.host, flags.port).close()  # the core binds it again (SO_REUSEADDR)
    return level, template
