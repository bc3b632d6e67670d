"""The packages depend only downward (docs/architecture.md): the rank process, the package
builder and the runtime never import the frontend; the engine core and the API servers never
import each other or the cluster tools; and serving on one machine does not load asyncssh."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# package -> the first-party packages it must not import
FORBIDDEN = {
    "ranks": ("orbit",),
    "prepare": ("orbit", "ranks"),
    "runtime": ("orbit", "ranks", "prepare"),
    "proto": ("orbit", "ranks", "prepare", "runtime"),
    "orbit/core": ("orbit.http", "orbit.cluster", "orbit.serve", "orbit.cli", "ranks"),
    "orbit/http": ("orbit.core", "orbit.cluster", "orbit.serve", "orbit.cli", "ranks"),
    "orbit/cluster": ("orbit.http", "orbit.serve", "orbit.cli", "ranks"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_dependencies_point_down():
    wrong = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for name in _imports(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_serving_on_one_machine_does_not_load_asyncssh():
    code = (
        "import sys, orbit.cli, orbit.serve, orbit.http.server, orbit.http.app; "
        "print('asyncssh' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
