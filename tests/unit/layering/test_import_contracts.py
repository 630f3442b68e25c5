"""The package's import graph: the layer and model-seam contracts (pyproject.toml
[tool.importlinter]) hold, each catches its violation, and the graph has no cycle,
function-local imports included."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[3]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_layer_contract_is_kept() -> None:
    done = _lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


def test_a_back_import_breaks_the_contract(tmp_path: Path) -> None:
    """data (a low layer) importing the trainer (a high one) fails the lint step, naming both."""
    shutil.copytree(REPO / "primus_v4", tmp_path / "primus_v4")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    thd = tmp_path / "primus_v4" / "data" / "thd.py"
    thd.write_text(thd.read_text() + "\n\ndef _late():\n    import primus_v4.training.trainer\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0
    assert "BROKEN" in done.stdout
    assert "primus_v4.data.thd -> primus_v4.training.trainer" in done.stdout


def test_a_model_family_import_above_models_breaks_the_seam(tmp_path: Path) -> None:
    """The trainer naming DeepSeek-V4 directly (not through its spec) fails the lint step."""
    shutil.copytree(REPO / "primus_v4", tmp_path / "primus_v4")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    trainer = tmp_path / "primus_v4" / "training" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\n\nimport primus_v4.models.deepseek_v4  # noqa\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0
    assert "the model seam: nothing outside models/ imports a model family BROKEN" in done.stdout
    assert "primus_v4.training.trainer -> primus_v4.models.deepseek_v4" in done.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_import_graph_has_no_cycle() -> None:
    sys.path.insert(0, str(REPO))
    graph = grimp.build_graph("primus_v4", cache_dir=None)
    assert len(graph.modules) > 80  # the whole package was scanned
    assert _cycles(graph) == []


def test_cycle_finder_sees_a_cycle(tmp_path: Path) -> None:
    """The same finder reports a circle closed by a function-local import."""
    pkg = tmp_path / "circ"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from circ import b\n")
    (pkg / "b.py").write_text("def f():\n    from circ import a\n")
    sys.path.insert(0, str(tmp_path))
    try:
        graph = grimp.build_graph("circ", cache_dir=None)
    finally:
        sys.path.remove(str(tmp_path))
    assert _cycles(graph) == [["circ.a", "circ.b"]]
