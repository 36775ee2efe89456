"""The package's shape holds as it grows: imports point down the layers (LAYERS below: which layer may import
which), the only import circle is the patch registry's, no module runs over 450 lines, no function over 50, no
constructor takes more than 8 parameters, and few of our own modules are imported inside functions (each such
import is a heavy optional one, or breaks a circle)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hybridflow"
# Lowest first. A module may import its own layer and those below; never one above.
LAYERS = [
    {"util", "device", "rng", "spawn", "protocol", "patches", "families", "registry"},
    {"config"},
    {"algorithms", "models", "rewards", "data", "controller", "versions"},
    {"plan"},
    {"megatron", "rollout", "agent", "resharding"},
    {"workers"},
    {"trainer"},
    {"tools", "cli", "__init__"},
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
MAX_FUNCTION_LINES = 50
MAX_MODULE_LINES = 450
MAX_CONSTRUCTOR_PARAMETERS = 8  # besides self
MAX_LOCAL_IMPORTS = 44  # a third of the 133 counted when the run plan landed (issue 29)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _targets(module: str, node) -> list[str]:
    """Our modules an import statement names (the module itself when it imports a name from it)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if not MODULES[module].name == "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != "hybridflow" and name != module:
            out.append(name)
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports():
    """(importer, imported, the import statement if inside a function else None) for every import of ours."""
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, node):
                    yield module, target, (module, node.lineno) if id(node) in local else None


def test_imports_point_down_the_layers():
    upward = sorted({f"{a} -> {b}" for a, b, _ in _imports() if LAYER[_package(b)] > LAYER[_package(a)]})
    assert not upward, "imports that run back up a layer:\n" + "\n".join(upward)


def test_the_only_import_circle_is_the_patch_registrys():
    graph = collections.defaultdict(set)
    for a, b, _ in _imports():
        graph[a].add(b)
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    outside = [sorted(c) for c in circles if not all(m.startswith("hybridflow.patches") for m in c)]
    assert len(circles) <= 1 and not outside, f"import circles: {outside}"


def _functions():
    for m, path in MODULES.items():
        for f in ast.walk(ast.parse(path.read_text())):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield m, f


def test_no_function_is_over_50_lines():
    long = [f"{m}.{f.name}: {f.end_lineno - f.lineno + 1} lines" for m, f in _functions()
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "\n".join(long)


def test_no_module_is_over_450_lines():
    long = [f"{m}: {n} lines" for m, path in MODULES.items()
            if (n := path.read_text().count("\n")) > MAX_MODULE_LINES]
    assert not long, "\n".join(long)


def test_no_constructor_takes_more_than_8_parameters():
    wide = [f"{m}:{f.lineno}: {n} parameters" for m, f in _functions() if f.name == "__init__"
            and (n := len(f.args.posonlyargs) + len(f.args.args) - 1 + len(f.args.kwonlyargs))
            > MAX_CONSTRUCTOR_PARAMETERS]
    assert not wide, "\n".join(wide)


def test_few_imports_of_our_own_modules_inside_functions():
    statements = sorted({inside for _, _, inside in _imports() if inside})
    assert len(statements) <= MAX_LOCAL_IMPORTS, statements


def _strongly_connected(graph) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


# Facts the run plan and the model families derive once, by the expressions their old copies used (issue 29):
# none may come back outside the module that owns it.
OWNED = {
    r"use_kl_in_reward or ": "plan/needs.py",  # does the run need a reference
    r"adv_estimator (==|in |not in )": "plan/needs.py",  # what an estimator needs: declared when it registers
    r"\.use_critic\b|critic\.placement ==": "plan/",  # the critic and its pool
    r"n_workers (//|%)|critic_n_workers (//|%)": "plan/",  # pool arithmetic
    r"\"num_experts\"": "families/",  # is it MoE, how many experts
    # a megatron role's layout (issue 45): each fact is a ParallelLayout property or function of plan/layout.py
    r"\[\"dp_size\"\] \*|\bdp \* (self\.)?cp\b": "plan/layout.py",  # weight replicas (data x context)
    r"\bep > 1 or|expert_model_parallel_size > 1 or": "plan/layout.py",  # whether the transition moves experts
    r"if \w+(\.\w+)*\.sequence_parallel else 1": "plan/layout.py",  # the sequence multiple
    r"2 \* \w+ if \w+ > 1 else 1": "plan/layout.py",  # context-parallel chunks
    r"mini_batch_size \* \w+ //|\* rollout_n //": "plan/layout.py",  # a mini-batch's rows per rank
    r"return .*\bpp(_size)? \+ 1\b": "plan/layout.py",  # the fewest micro-batches with virtual stages
}


def test_each_derived_fact_has_one_definition():
    import re

    found = []
    for module, path in MODULES.items():
        text, where = path.read_text(), str(path.relative_to(PACKAGE))
        for pattern, owner in OWNED.items():
            if not where.startswith(owner):
                found += [f"{where}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)!r} (owned by {owner})"
                          for m in re.finditer(pattern, text)]
    assert not found, "\n".join(found)


def test_workers_read_their_role_spec_not_the_experiment_config():
    """Each worker group is given its role's spec (hybridflow/plan/specs.py); none reads the whole config."""
    import re

    found = [f"{path.name}:{n}: {line.strip()}" for path in (PACKAGE / "workers").glob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bcfg\.(trainer|data|algorithm|rollout|actor|critic|resources|model)\b|ExperimentConfig", line)]
    assert not found, "\n".join(found)
