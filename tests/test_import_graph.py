"""The package's import graph has no cycle (issue 19: layers, a leaf that modes import and that imports no mode).

Every ``import``/``from ... import`` in ``cp_ops/`` counts, module level or inside a function (a lazy import still
makes the modules depend on each other). ``from . import x`` counts as a dependency on the submodule ``x`` only; a name
taken from a package's ``__init__`` counts as a dependency on that package."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "cp_ops")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def _imports(name: str, path: str, mods: dict) -> set[str]:
    is_pkg = path.endswith("__init__.py")
    deps = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = (name if is_pkg else name.rsplit(".", 1)[0]).split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                mod = base + ("." + node.module if node.module else "")
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
            deps.update(subs)
            if len(subs) < len(node.names) and mod in mods:
                deps.add(mod)
    deps.discard(name)
    return deps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_cp_ops():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert "cp_ops.plan" in graph and "cp_ops.kernels.sdpa" in graph  # the walk found the package
    cycles = _cycles(graph)
    detail = "; ".join(" / ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles)
    assert not cycles, f"import cycles: {detail}"


def test_no_submodule_shares_a_public_name():
    """A submodule named like a public function (``cp_ops.attention``, ``cp_ops.compile``) would be bound over the
    function when imported before the core loads (the import system sets each loaded submodule on its package)."""
    import cp_ops

    subs = {m.split(".")[1] for m in _modules() if m.count(".") >= 1}
    assert "api" in subs and not subs & (set(cp_ops.__all__) - {"modes"}), subs & set(cp_ops.__all__)


def test_the_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_leaves_import_nothing_above_them():
    """kernels/ imports no mode, comm, plan or API (the layouts, a leaf of torch code, it may: the fused FP8 codec's
    torch version packs with them); modes/ (the bodies and their registry) imports only kernels/ and the layouts."""
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert graph["cp_ops.layout"] <= {"cp_ops.validate"}, graph["cp_ops.layout"]
    for m in (n for n in graph if n.startswith("cp_ops.kernels")):
        bad = {d for d in graph[m] if not d.startswith(("cp_ops.kernels", "cp_ops._ext", "cp_ops.layout"))}
        assert not bad, (m, bad)
    bodies = [n for n in graph if n == "cp_ops.modes" or n.startswith("cp_ops.modes.")]
    assert len(bodies) >= 5, bodies
    for m in bodies:
        bad = {d for d in graph[m] if not d.startswith(("cp_ops.kernels", "cp_ops.layout", "cp_ops.modes"))}
        assert not bad, (m, bad)


def test_the_plan_is_the_one_home_of_a_decision():
    """The decision's modules live in cp_ops.plan: the rules (cp_ops.plan.rules) keep no mutable module state beside
    their table of stage counts and read no file; the stored and measured choices are cp_ops.plan.measured; nothing
    outside cp_ops.plan (but the API, which hands it the call, and the tools) imports the plan's internals."""
    mods = _modules()
    tree = ast.parse(open(mods["cp_ops.plan.rules"]).read())
    state = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            v = node.value
            if isinstance(v, (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp, ast.ListComp)) or (
                    isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("dict", "set", "list")):
                state.append(ast.unparse(node)[:60])
    assert [s for s in state if not s.startswith("HEURISTIC_CHUNKS")] == [], state
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"json", "os", "fcntl"}, imported
    for gone in ("cp_ops.dispatch", "cp_ops.dispatch_mesh", "cp_ops.split", "cp_ops.choices", "cp_ops.modes.tune",
                 "cp_ops.modes.pipelined"):
        assert gone not in mods, gone
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    core = {m for m in graph if not m.startswith(("cp_ops.plan", "cp_ops.cli", "cp_ops.integrations"))} - {
        "cp_ops.api", "cp_ops"}
    reach = {m: sorted(d for d in graph[m] if d.startswith("cp_ops.plan.") and d not in ("cp_ops.plan.rules",))
             for m in core}
    assert not {m: r for m, r in reach.items() if r}, reach
