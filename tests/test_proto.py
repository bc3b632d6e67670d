"""The committed *_pb2.py modules are what proto/generate.py makes from the .proto files."""

from pathlib import Path

from proto.generate import HERE


def test_generated_modules_are_current(tmp_path):
    committed = {p.name: p.read_text() for p in HERE.glob("*_pb2.py")}
    regenerated = {p.name: p.read_text() for p in _regenerate(tmp_path)}
    assert committed == regenerated, "run `python -m proto.generate` and commit the result"


def _regenerate(tmp_path: Path) -> list[Path]:
    import shutil

    copy = tmp_path / "repo" / "proto"
    shutil.copytree(HERE, copy, ignore=shutil.ignore_patterns("*_pb2.py", "__pycache__"))
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_copy", copy / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.generate()
