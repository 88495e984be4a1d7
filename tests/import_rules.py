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


# The architecture rules (design.md, "The course's shape"): layering, @patch never overriding, one base class.
LOW_LAYERS = ("layers", "kernels", "models", "utils")  # below the engine: they never import engine/
ENGINE_MUST_NOT_IMPORT = ("course", "serve", "bench", "labs", "llm", "online")  # what sits on top of the engine


def layering_violations(package_dir: Path) -> list[str]:
    """One message per import that goes up the layers: layers/kernels/models/utils importing engine/, or
    engine/ importing course/, serve/, bench/, labs/ or the user-facing llm.py / online.py."""
    modules = load_modules(package_dir)
    top = package_dir.name
    problems = []
    for module in modules.values():
        parts = module.name.split(".")
        if len(parts) < 3 and not (len(parts) == 2 and module.path.name == "__init__.py"):
            continue  # a top-level module (config, llm, ...) may import what it needs
        layer = parts[1]
        for line, target in imports_of(module, modules):
            target_layer = target.split(".")[1] if target.count(".") else ""
            if (layer in LOW_LAYERS and target_layer == "engine") or (
                    layer == "engine" and target_layer in ENGINE_MUST_NOT_IMPORT):
                problems.append(f"{module.path}:{line} ({top}.{layer}) imports {target}")
    return problems


def _classes(package_dir: Path) -> tuple[dict, dict, list]:
    """Every class: its bases' names and the methods its body defines; and every @patch-ed method as
    (class name, method name, where)."""
    bases, bodies, patched = {}, {}, []
    for module in load_modules(package_dir).values():
        for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                bodies[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    "patch" in ast.unparse(d) for d in node.decorator_list) and node.args.args:
                owner = node.args.args[0].annotation
                for name in ([n.id for n in ast.walk(owner) if isinstance(n, ast.Name)] if owner else []):
                    patched.append((name, node.name, f"{module.path}:{node.lineno}"))
    return bases, bodies, patched


def patch_overrides(package_dir: Path) -> list[str]:
    """@patch grows a class inside its notebook only with methods nobody overrides: one message per patched
    method that a subclass overrides, or that overrides a method of a base class."""
    bases, bodies, patched = _classes(package_dir)
    for name, method, _ in patched:
        bodies.setdefault(name, set()).add(method)

    def ancestors(name: str, seen: frozenset = frozenset()):
        for base in bases.get(name, []):
            if base in bases and base not in seen:
                yield base
                yield from ancestors(base, seen | {base})

    problems = set()
    for name, method, where in patched:
        if method.startswith("__"):
            continue
        problems |= {f"{where} @patch {name}.{method} overrides {a}.{method}" for a in ancestors(name)
                     if method in bodies.get(a, set())}
        problems |= {f"{where} @patch {name}.{method} is overridden in {sub}" for sub in bases
                     if name in ancestors(sub) and method in bodies.get(sub, set())}
    return sorted(problems)


def multi_base_classes(package_dir: Path) -> list[str]:
    """Classes with two or more of the package's classes as bases (mixin chains)."""
    bases, _, _ = _classes(package_dir)
    return [f"{name}({', '.join(b for b in bs if b in bases)})" for name, bs in bases.items()
            if sum(b in bases for b in bs) > 1]
