"""The course's import rules, read from the package's source with `ast` (used by test_00_import_rules.py).

Every exported module names its notebook in its header ("File to edit: .../notebooks/NN_topic.ipynb").
Course order is the sorted order of the notebook file names. A module exported from notebook N must not
import (anywhere, function bodies included) a module exported from a later notebook; only the package's
top-level __init__.py and __main__.py may. No import cycles at all."""
import ast
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = re.compile(r"File to edit: (?:\.\./)+notebooks/([^ ]+\.ipynb)")
EXEMPT = ("__init__.py", "__main__.py")  # the package's top level only


@dataclass
class Module:
    name: str            # dotted, e.g. pkg.engine.scheduler (a package is its __init__)
    path: Path
    notebook: str | None  # the notebook that exports it (None: a hand-written file such as a package marker)


def load_modules(package_dir: Path) -> dict[str, Module]:
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        head = "\n".join(path.read_text(encoding="utf-8").splitlines()[:3])
        match = HEADER.search(head)
        modules[name] = Module(name, path, match.group(1) if match else None)
    return modules


def imports_of(module: Module, modules: dict[str, Module]) -> list[tuple[int, str]]:
    """(line, imported package module) for every import statement of `module`, resolved to known modules."""
    is_pkg = module.path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.name if is_pkg else module.name.rsplit(".", 1)[0]
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            names = [target] + [f"{target}.{alias.name}" for alias in node.names]
        else:
            continue
        resolved = set()
        for name in names:
            while name and name not in modules:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name and name != module.name:
                resolved.add(name)
        found += [(node.lineno, name) for name in sorted(resolved)]
    return found


def forward_imports(package_dir: Path, notebooks: list[str]) -> list[str]:
    """One message per import of a later notebook's module: file, line and both notebooks."""
    order = {nb: i for i, nb in enumerate(sorted(notebooks))}
    modules = load_modules(package_dir)
    problems = []
    for module in modules.values():
        exempt = module.path.parent == package_dir and module.path.name in EXEMPT
        if module.notebook is not None and module.notebook not in order:
            problems.append(f"{module.path}: its header names {module.notebook}, which is not a course notebook")
            continue
        if exempt or module.notebook is None:
            continue
        for line, target in imports_of(module, modules):
            target_nb = modules[target].notebook
            if target_nb in order and order[target_nb] > order[module.notebook]:
                problems.append(f"{module.path}:{line} imports {target}, exported from {target_nb}, "
                                f"a later notebook than {module.notebook}")
    return problems


def import_cycles(package_dir: Path) -> list[list[str]]:
    """Strongly connected groups of modules that import each other (a package and its own submodules
    are not counted: importing a package runs its __init__, which may import its children)."""
    modules = load_modules(package_dir)
    graph = {name: {t for _, t in imports_of(m, modules)} for name, m in modules.items()}
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    nested = lambda g: all(any(o.startswith(x + ".") or x.startswith(o + ".") for o in g if o != x) for x in g)
    return [g for g in groups if not nested(g)]
