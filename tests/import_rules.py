"""The course's order and the package's architecture, read from source with `ast` (test_00_import_rules.py).

Course order is the sorted order of the notebook file names. A module's writers are the notebooks its
header and its cell markers name (`# %% ../notebooks/NN_topic.ipynb #cell-id`, at any indentation: a
method folded into a class keeps its cell's marker); a module *starts* in the first of them. The order rule,
per cell: the code a notebook's cells export, and every import in its cells (exported or not), uses only
modules that this or an earlier notebook starts. A later lesson may refactor an earlier module, and the code
it adds there may import what that later lesson starts. No import cycles at all.

The architecture rules (design.md, "The course's shape"; `../shared/tools/arch_rules.py` checks the same):
layers/, kernels/, models/, utils/ never import engine/, kernels/ never import layers/ or models/, engine/
never imports what sits on top of it; no class has two of the package's classes as bases; inheritance among
them is at most two deep; every method sits in its class's body (`methods_outside_class_body`)."""
import ast
import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^\s*#.*?(?:\.\./)+notebooks/([^ /,]+\.ipynb)")


@dataclass
class Module:
    name: str              # dotted, e.g. pkg.engine.scheduler (a package is its __init__)
    path: Path
    writers: list[str]     # notebooks named in its header and cell markers, in course (sorted) order
    line_writer: list[str | None]  # per line (index 0 = line 1): the notebook whose cell wrote it

    @property
    def notebook(self) -> str | None:
        """The notebook it starts in (None: a hand-written file, such as a package marker)."""
        return self.writers[0] if self.writers else None


def load_modules(package_dir: Path) -> dict[str, Module]:
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        writers, line_writer, current = set(), [], None
        for line in path.read_text(encoding="utf-8").splitlines():
            match = MARKER.match(line)
            if match:
                writers.add(match.group(1))
                if "# %%" in line:
                    current = match.group(1)
            line_writer.append(current)
        modules[name] = Module(name, path, sorted(writers), line_writer)
    return modules


def _resolve(names: list[str], modules: dict, own: str) -> set[str]:
    """The package modules that dotted `names` refer to (the longest known prefix of each)."""
    resolved = set()
    for name in names:
        while name and name not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        if name and name != own:
            resolved.add(name)
    return resolved


def _import_targets(node: ast.AST, package: str | None) -> list[str]:
    """Dotted names an import statement names; `package` is the package a relative import is relative to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        if package is None:
            return []
        base = package
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def imports_of(module: Module, modules: dict[str, Module]) -> list[tuple[int, str]]:
    """(line, imported package module) for every import statement of `module`, function bodies included."""
    package = module.name if module.path.name == "__init__.py" else module.name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"))):
        found += [(node.lineno, t) for t in sorted(_resolve(_import_targets(node, package), modules, module.name))]
    return found


def _cell_tree(source: str) -> ast.Module | None:
    """A code cell's AST, IPython magics and shell lines blanked; None if it still does not parse."""
    try:
        return ast.parse("\n".join("" if re.match(r"\s*[%!]", line) else line for line in source.splitlines()))
    except SyntaxError:
        return None


def imports_ahead(package_dir: Path, notebooks_dir: Path) -> list[str]:
    """One message per import, in exported code or in any notebook cell, of a module that only a later
    notebook starts."""
    order = {nb.name: i for i, nb in enumerate(sorted(notebooks_dir.glob("*.ipynb")))}
    modules = load_modules(package_dir)
    starts = {name: order.get(m.notebook) for name, m in modules.items()}
    problems = [f"{m.path}: names {nb}, which is not a course notebook"
                for m in modules.values() for nb in m.writers if nb not in order]
    for module in modules.values():
        for line, target in imports_of(module, modules):
            writer = module.line_writer[line - 1]
            if writer in order and starts[target] is not None and starts[target] > order[writer]:
                problems.append(f"{module.path}:{line} (written by {writer}) imports {target}, which "
                                f"{modules[target].notebook} starts")
    top = package_dir.name
    for nb, index in order.items():
        cells = json.loads((notebooks_dir / nb).read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            tree = _cell_tree("".join(cell["source"])) if cell["cell_type"] == "code" else None
            for node in ast.walk(tree) if tree else []:
                for target in sorted(_resolve(_import_targets(node, None), modules, "")):
                    if target.split(".")[0] == top and starts[target] is not None and starts[target] > index:
                        problems.append(f"{nb} cell {i} imports {target}, which {modules[target].notebook} starts")
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


LOW_LAYERS = ("layers", "kernels", "models", "utils")  # below the engine: they never import engine/
ABOVE_KERNELS = ("layers", "models", "engine")  # kernels know no layer: layers choose kernels
ENGINE_MUST_NOT_IMPORT = ("course", "serve", "bench", "labs", "llm", "online")  # what sits on top of the engine


def layering_violations(package_dir: Path) -> list[str]:
    """One message per import that goes up the layers: layers/kernels/models/utils importing engine/,
    kernels/ importing layers/, models/ or engine/, engine/ importing course/, serve/, bench/, labs/ or the
    user-facing llm.py / online.py."""
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
                    layer == "kernels" and target_layer in ABOVE_KERNELS) or (
                    layer == "engine" and target_layer in ENGINE_MUST_NOT_IMPORT):
                problems.append(f"{module.path}:{line} ({top}.{layer}) imports {target}")
    return problems


def _class_bases(package_dir: Path) -> dict[str, list[str]]:
    """Every class of the package: the names of its bases."""
    bases = {}
    for module in load_modules(package_dir).values():
        for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
    return bases


def multi_base_classes(package_dir: Path) -> list[str]:
    """Classes with two or more of the package's classes as bases (mixin chains)."""
    bases = _class_bases(package_dir)
    return [f"{name}({', '.join(b for b in bs if b in bases)})" for name, bs in bases.items()
            if sum(b in bases for b in bs) > 1]


def deep_classes(package_dir: Path, limit: int = 2) -> list[str]:
    """Classes with more than `limit` levels of the package's classes above them."""
    bases = _class_bases(package_dir)

    def depth(name: str, seen: frozenset) -> int:
        above = [b for b in bases.get(name, []) if b in bases and b not in seen]
        return 1 + max(depth(b, seen | {b}) for b in above) if above else 0

    return [f"{name}: {depth(name, frozenset({name}))} levels" for name in bases
            if depth(name, frozenset({name})) > limit]


def patch_decorators(package_dir: Path) -> list[str]:
    """Every function of the package still decorated with fastcore's @patch (the export folds them)."""
    found = []
    for module in load_modules(package_dir).values():
        for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    re.match(r"(\w+\.)?patch\b", ast.unparse(d)) for d in node.decorator_list):
                found.append(f"{module.path}:{node.lineno} @patch {node.name}")
    return found


def methods_outside_class_body(module) -> list[str]:
    """Methods of the classes an imported module defines that were not written inside the class statement
    (fastcore's @patch, `Cls.method = function`): one message each, naming where the function was written."""
    tree = ast.parse(inspect.getsource(module))
    package_dir = Path(importlib.import_module(module.__name__.split(".")[0]).__file__).resolve().parent
    spans = {}  # qualified class name -> (first, last) line of its class statement

    assigned = {}  # qualified class name -> names its body assigns (`NAME = staticmethod(function)`)

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef):
                spans[prefix + node.name] = (node.lineno, node.end_lineno)
                assigned[prefix + node.name] = {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                                                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                                if isinstance(t, ast.Name)}
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    problems = []
    for qualname, (first, last) in spans.items():
        cls = module
        for part in qualname.split("."):
            cls = getattr(cls, part, None)
        if not inspect.isclass(cls):
            continue  # redefined or deleted under another name: nothing to check here
        for attr, value in vars(cls).items():
            if attr in assigned[qualname]:
                continue  # the class statement holds it, whatever function it names
            funcs = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [
                getattr(value, "__func__", value)]
            for func in funcs:
                func = inspect.unwrap(func) if callable(func) else None
                code = getattr(func, "__code__", None)
                if code is None:
                    continue
                where = Path(code.co_filename).resolve()
                if code.co_filename.startswith("<") or package_dir not in where.parents:
                    continue  # generated (a dataclass's __init__) or a library's function held as an attribute
                if where != Path(module.__file__).resolve() or not first <= code.co_firstlineno <= last:
                    problems.append(f"{module.__name__}.{qualname}.{attr} is written at "
                                    f"{Path(code.co_filename).name}:{code.co_firstlineno}, outside the class statement "
                                    f"(lines {first}-{last})")
    return problems


def package_modules(package: str) -> list:
    """Every module of an importable package but its `__main__` scripts, imported (one that fails raises)."""
    root = Path(importlib.import_module(package).__file__).parent
    names = {".".join((package,) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
             for p in root.rglob("*.py") if p.stem != "__main__"}
    return [importlib.import_module(name) for name in sorted(names)]
