"""Every device-side assert message in cp_ops fits CUDA's limit: ``torch._assert_async(cond, msg)`` on a CUDA tensor
refuses a message of 255 bytes or more (RuntimeError "Message length must be smaller than 255", raised on the first
call on a GPU; the CPU path accepts any length, so CPU tests never see it). A message built at run time (an
f-string, a call) cannot be bounded here and is refused too: name a module constant instead."""

import ast
import pathlib

import cp_ops

LIMIT = 255  # bytes, exclusive
ASSERTS = {"_assert_async"}  # torch's device asserts that take a message


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` (implicit concatenation is one literal in the AST)."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def _device_asserts():
    """``(file:line, message or None where it is not a literal / module constant)`` for every call in cp_ops."""
    root = pathlib.Path(cp_ops.__file__).parent
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        consts = _constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name not in ASSERTS:
                continue
            msg = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords
                                                                if k.arg == "assert_msg"), None)
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
                yield where, msg.value
            elif isinstance(msg, ast.Name) and msg.id in consts:
                yield where, consts[msg.id]
            else:
                yield where, None


def test_device_assert_messages_fit_cuda_limit():
    found = list(_device_asserts())
    assert found, "no torch._assert_async call found: the scan no longer sees cp_ops' key-mask check"
    bad = [(where, None if m is None else len(m.encode())) for where, m in found
           if m is None or len(m.encode()) >= LIMIT]
    assert not bad, f"device-assert messages must be literals (or module constants) under {LIMIT} bytes; got {bad}"


def test_the_scan_sees_a_long_or_runtime_message(tmp_path, monkeypatch):
    """The scan itself: a long constant, an f-string and a short literal, in a package laid out as cp_ops."""
    pkg = tmp_path / "cp_ops"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("import torch\nLONG = '" + "x" * 300 + "'\n"
                              "torch._assert_async(c, LONG)\ntorch._assert_async(c, f'{n} bad')\n"
                              "torch._assert_async(c, 'short')\n")
    monkeypatch.setattr(cp_ops, "__file__", str(pkg / "__init__.py"))
    got = [(w.rsplit(":", 1)[1], None if m is None else len(m)) for w, m in _device_asserts()]
    assert got == [("3", 300), ("4", None), ("5", 5)], got
