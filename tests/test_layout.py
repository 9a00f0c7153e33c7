"""Import direction (DESIGN.md, "Layout"): the package's imports form no cycle, the Triton kernels
install as ``staged_engine.kernels`` (no top-level module), and generating with the demo pair
never imports the training code."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import staged_engine

PACKAGE = Path(staged_engine.__file__).resolve().parent
KERNELS = Path(__file__).resolve().parents[1] / "kernels"
NATIVE = {"staged_engine._cpu", "staged_engine._ngram"}  # compiled leaves


def _modules() -> dict[str, Path]:
    mods = {}
    for root, prefix in ((PACKAGE, ("staged_engine",)), (KERNELS, ("staged_engine", "kernels"))):
        for path in root.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (lazy imports included).
    ``from pkg import mod`` counts as importing pkg.mod, as import-linter counts it."""
    mods = _modules()
    known = set(mods) | NATIVE
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
                targets = subs or [base]
            else:
                continue
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name and target in mods:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_package_has_no_import_cycles():
    graph = import_graph()
    assert "staged_engine.spec.decoders" in graph and "staged_engine.kernels.verify" in graph
    assert cycles(graph) == []


def test_layers_point_one_way():
    """model/ never imports the strategies above it; the runtime never imports training or the CLI."""
    graph = import_graph()
    upper = ("staged_engine.spec", "staged_engine.beam", "staged_engine.engine", "staged_engine.cli")
    for name, targets in graph.items():
        if name.startswith("staged_engine.model"):
            assert not [t for t in targets if t.startswith(upper)], name
        if not name.startswith(("staged_engine.cli", "staged_engine.training")):
            assert not [t for t in targets if t.startswith(("staged_engine.training", "staged_engine.cli"))], name


def test_no_top_level_kernels_module_is_installed(tmp_path):
    code = ("import importlib.util, staged_engine.kernels as k; "
            "print(importlib.util.find_spec('kernels') is None, k.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "staged_engine.kernels"]


def test_generation_imports_no_training_module():
    code = ("import sys; from staged_engine import Engine; "
            "eng = Engine.demo(ngram=False); eng.generate('def f(x):\\n', max_new_tokens=4, strategy='tree'); "
            "bad = sorted(m for m in sys.modules if m.startswith(('staged_engine.training', 'staged_engine.cli'))); "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_command_line_answers_help_without_loading_torch():
    """``staged-engine --help`` and every command's ``--help`` build the parser from plain data
    (``staged_engine.options``): neither torch nor the C++ extensions load (it took 2.4 s, now a
    fraction of one); importing the package alone loads neither either."""
    code = ("import sys, contextlib, io; from staged_engine.cli.main import build_parser, main; build_parser(); "
            "import staged_engine; "
            "cmds = ['demo', 'generate', 'profile', 'serve', 'ngram-build', 'train-demo', 'train-pilot', 'bench']; "
            "codes = []\n"
            "for argv in [['--help']] + [[c, '--help'] for c in cmds]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try: main(argv)\n"
            "        except SystemExit as e: codes.append(e.code)\n"
            "print(codes, sorted(m for m in sys.modules if m == 'torch' or m.startswith('staged_engine._')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 0, 0, 0, 0, 0, 0, 0, 0] []"


def test_the_package_names_load_on_first_use():
    """``staged_engine.Engine`` and the other public names resolve lazily, to the real objects."""
    import staged_engine as pkg
    from staged_engine.engine import Engine, GenerationResult
    from staged_engine.ngram import NGramModel
    from staged_engine.sampling import SamplingParams

    assert (pkg.Engine, pkg.GenerationResult, pkg.SamplingParams, pkg.NGramModel) == (
        Engine, GenerationResult, SamplingParams, NGramModel)
    assert set(pkg.__all__) == {"Engine", "GenerationResult", "SamplingParams", "NGramModel"}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pkg.nothing  # noqa: B018
