"""Regenerate proto/*_pb2.py from the .proto files: `python -m proto.generate`.

The generated modules are committed because the GPU machine has no protoc. protoc stamps a
runtime-version check into them that refuses older protobuf runtimes; the GPU image pins a
different protobuf than CI, and the builder API the modules use has been stable since 3.20, so
the check is removed here.
"""

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION_CHECK = re.compile(
    r"^from google\.protobuf import runtime_version as _runtime_version\n"
    r"|^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n",
    re.MULTILINE,
)


def generate(out_dir: Path = HERE) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(HERE.glob("*.proto"))
    args = ["protoc", f"-I{HERE.parent}", f"--python_out={out_dir.parent}"]
    if protoc.main(args + [str(p.relative_to(HERE.parent)) for p in protos]) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for p in protos:
        module = out_dir / f"{p.stem}_pb2.py"
        module.write_text(VERSION_CHECK.sub("", module.read_text()))
        written.append(module)
    return written


if __name__ == "__main__":
    for path in generate():
        print(path, file=sys.stderr)
