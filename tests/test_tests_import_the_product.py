"""The tests import the product (cp_ops, its tools under cp_ops.cli) and their own helpers, never the benchmark
scripts (a script is tested through its command line) nor the launcher's private names."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield from ((node.module, a.name) for a in node.names)


def test_no_test_imports_a_benchmark_script_or_a_private_launcher_name():
    bad = [f"{p.name}: {m}{'.' + n if n else ''}" for p in sorted(TESTS.glob("*.py")) for m, n in _imports(p)
           if m.split(".")[0] == "benchmarks" or (m == "cp_ops.cli.launch" and n and n.startswith("_"))]
    assert not bad, bad
