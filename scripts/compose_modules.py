"""Compose one package module from the exported cells of every notebook that writes it, in course order.

Used by scripts/export_notebooks.py. The rules, in the order a cell's statements are added to the module:

- **A new definition is appended**: the statement goes at the end of the module, under its cell's marker
  (`# %% ../notebooks/NN_topic.ipynb #cell-id`), as nbdev writes it.
- **A definition with a name the module already has replaces it in place**: a top-level `def`, `class` or
  `NAME = ...` from a later cell (of a later notebook, or the same one) takes the place of the earlier one,
  under its own cell's marker, so the package holds one version, where the reader of the module expects it;
  the earlier version lives on in its notebook. An assignment that reads the name it assigns
  (`TILES = TILES | {...}`) extends the earlier value instead, so it is appended.
- **A method grown with fastcore's `@patch` is folded into its class's body**: `@patch def step(self: Engine)`
  becomes `def step(self)` inside `class Engine` (`@patch(as_prop=True)` becomes `@property`), after the
  methods already there, with its cell's marker indented above it; a method of the same name is replaced in
  place. The class must be defined in the same module, earlier in course order. `from fastcore.basics import
  patch` is dropped, so the package needs no fastcore.

What a folded or in-place definition runs when Python defines it (decorators, default values, base classes)
must already be defined at the place it lands: the composer refuses the cell otherwise, naming the name and
the fix. A folded method's annotations are quoted where they name what is not defined above its class (the
class itself, a class further down), as they would otherwise fail when the class statement runs.
"""
import ast
import builtins
import io
import tokenize
from dataclasses import dataclass, field

INDENT = "    "
PATCH_IMPORT_MODULES = ("fastcore.basics", "fastcore.all", "fastcore.meta")


class ComposeError(SystemExit):
    """A cell the composer cannot place; the message names the notebook, the cell and the fix."""


@dataclass
class Part:
    """One top-level statement of the module (with the comments and blank lines above it), or one member of a
    class body; `origin` is the marker of the cell that wrote it."""
    origin: str
    lines: list[str]
    key: tuple | None = None  # ("def", name) or ("assign", name): what a later definition of the name replaces
    node: ast.stmt | None = None
    members: list["Part"] | None = None  # a class whose body has been opened to fold methods into it
    head: list[str] = field(default_factory=list)  # a class: its lines before the first member
    tail: list[str] = field(default_factory=list)  # a class: blank lines and comments after the last member


def _col(line: str, byte_col: int) -> int:
    """ast's column offsets count UTF-8 bytes; this is the index into the str."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _start(node: ast.stmt) -> int:
    """First line of a statement, its decorators included (1-based)."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _key(node: ast.stmt | None) -> tuple | None:
    """What a later statement with the same key replaces: a def, a class, or a plain assignment of one name
    whose value does not read that name."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return ("def", node.name)
    if isinstance(node, ast.ClassDef):
        extends = any(isinstance(n, ast.Name) and n.id == node.name for b in node.bases for n in ast.walk(b))
        return None if extends else ("def", node.name)  # class X(X): builds on the earlier X
    target = None
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        target = node.targets[0].id
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        target = node.target.id
    if target is None or any(isinstance(n, ast.Name) and n.id == target for n in ast.walk(node.value)):
        return None
    return ("assign", target)


def split_statements(lines: list[str], body: list[ast.stmt], first: int, last: int) -> list[tuple[ast.stmt | None, list[str]]]:
    """Cut lines[first-1:last] (1-based, inclusive) into the statements of `body`, each with the blank lines
    and comments above it; what follows the last statement stays with it. Statements sharing a line
    (`a = 1; b = 2`) stay together, with no node."""
    out, prev_end = [], first - 1
    for i, node in enumerate(body):
        end = last if i == len(body) - 1 else node.end_lineno
        if out and _start(node) <= prev_end:
            out[-1] = (None, out[-1][1] + lines[prev_end:end])
        else:
            out.append((node, lines[prev_end:end]))
        prev_end = max(prev_end, end)
    return out


def _is_patch(decorator: ast.expr) -> bool:
    func = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(func, ast.Name) and func.id == "patch") or (isinstance(func, ast.Attribute) and func.attr == "patch")


def _patch_decorator(node: ast.stmt | None) -> ast.expr | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return next((d for d in node.decorator_list if _is_patch(d)), None)
    return None


def _is_patch_import(node: ast.stmt | None, where: str) -> bool:
    """`from fastcore.basics import patch`: dropped. Anything else from fastcore would make the package need it."""
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastcore":
        if node.module in PATCH_IMPORT_MODULES and [a.name for a in node.names] == ["patch"]:
            return True
        raise ComposeError(f"{where}: imports {ast.unparse(node)!r}; the package must not need fastcore at run "
                           "time, so an exported cell may import only `patch` from fastcore.basics")
    if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "fastcore" for a in node.names):
        raise ComposeError(f"{where}: imports fastcore; the package must not need it at run time")
    return False


def _string_continuation_lines(source: str, node: ast.stmt) -> set[int]:
    """1-based lines inside a multi-line string literal that is not a docstring: indenting them would change
    the string's value."""
    docstrings = {(n.body[0].lineno, n.body[0].col_offset) for n in ast.walk(node)
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    inside = set()
    string_types = {tokenize.STRING} | {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in string_types and tok.end[0] > tok.start[0] and tok.start not in docstrings:
            inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    return inside


def fold_patched(lines: list[str], where: str, bound=lambda cls: set()) -> tuple[str, list[str], list[str]]:
    """A `@patch`-ed function's statement lines -> (its name, the classes it patches, its lines as a method):
    the decorator dropped (`as_prop=True` -> `@property`), `self: Cls` -> `self`, indented one level.
    `bound(cls)` names what the module has bound above class `cls`: an annotation naming anything else
    (the class itself, a class defined further down) is quoted, since the method's def line now runs inside
    the class statement; a decorator or default value naming anything else is an error."""
    node = ast.parse("\n".join(lines)).body[0]
    decorator = _patch_decorator(node)
    args = node.args.posonlyargs + node.args.args
    annotation = args[0].annotation if args else None
    if annotation is None:
        raise ComposeError(f"{where}: @patch def {node.name} needs its class as the annotation of its first "
                           "argument (`self: Scheduler`)")
    classes = [n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)]
    if not classes or any(isinstance(n, ast.Attribute) for n in ast.walk(annotation)) or \
            annotation.end_lineno != annotation.lineno:
        raise ComposeError(f"{where}: @patch def {node.name}: write its class as a plain name on one line "
                           f"(`self: Scheduler` or `self: A | B`), not {ast.unparse(annotation)!r}")
    keywords = {k.arg: ast.literal_eval(k.value) for k in getattr(decorator, "keywords", [])}
    if set(keywords) - {"as_prop"} or getattr(decorator, "args", []):
        raise ComposeError(f"{where}: @{ast.unparse(decorator)} cannot be folded; use @patch or @patch(as_prop=True)")
    if decorator.lineno == node.lineno or lines[decorator.lineno - 1].strip() != "@" + ast.unparse(decorator):
        raise ComposeError(f"{where}: write @patch alone on its line, above `def {node.name}`")
    known = set(dir(builtins)).union(*(bound(cls) for cls in classes))
    for expr in [d for d in node.decorator_list if d is not decorator] + node.args.defaults + \
            [d for d in node.args.kw_defaults if d is not None]:
        missing = sorted({n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} - known)
        if missing:
            raise ComposeError(f"{where}: def {node.name} uses {', '.join(missing)} in a decorator or default value, "
                               f"which the module defines below class {classes[0]}; define it above the class")
    keep = _string_continuation_lines("\n".join(lines), node)
    # edits as (row, start col, end col, new text): `self: Cls` -> `self`; an annotation naming what is not
    # bound above the class is quoted (inside the class body, the class's own name is not bound yet either)
    edits = [(annotation.lineno, args[0].col_offset + len(args[0].arg.encode()), annotation.end_col_offset, "")]
    a = node.args
    for arg in (a.posonlyargs + a.args)[1:] + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
        if arg.annotation is not None:
            edits.append(_quoted(arg.annotation, known, lines))
    if node.returns is not None:
        edits.append(_quoted(node.returns, known, lines))
    lines = list(lines)
    for row, start, end, text in sorted((e for e in edits if e), reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:_col(line, start)] + text + line[_col(line, end):]
    out = []
    for row, line in enumerate(lines, start=1):
        if row == decorator.lineno:
            if not keywords.get("as_prop"):
                continue
            line = "@property"
        out.append(line if not line.strip() or row in keep else INDENT + line)
    return node.name, classes, _strip_leading_blank(out)


def _quoted(annotation: ast.expr, known: set[str], lines: list[str]) -> tuple | None:
    """The edit that quotes `annotation` if it names anything not in `known` (`-> StepInputs` -> `-> "StepInputs"`)."""
    if all(n.id in known for n in ast.walk(annotation) if isinstance(n, ast.Name)):
        return None
    if annotation.end_lineno != annotation.lineno:
        raise ComposeError(f"write the annotation {ast.unparse(annotation)!r} on one line")
    line = lines[annotation.lineno - 1]
    text = line[_col(line, annotation.col_offset):_col(line, annotation.end_col_offset)]
    quote = "'" if '"' in text else '"'
    return (annotation.lineno, annotation.col_offset, annotation.end_col_offset, quote + text + quote)


def _bound_names(part: Part) -> set[str]:
    """Names a top-level statement binds (imports, defs, classes, assignment targets, for/with targets)."""
    node = part.node if part.node is not None else ast.parse("\n".join(part.lines))
    names, todo = set(), [node]
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
            continue  # what its body binds is local to it
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        todo.extend(ast.iter_child_nodes(n))
    return names


def _names_read_when_defined(node: ast.stmt) -> set[str]:
    """Names a top-level statement reads when it runs (not what function bodies read later): for a def its
    decorators, defaults and annotations; for a class its bases and what its body runs; else every name."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        exprs = node.decorator_list + a.defaults + [d for d in a.kw_defaults if d is not None] + [node.returns] + [
            x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None]
        return {n.id for e in exprs if e is not None for n in ast.walk(e) if isinstance(n, ast.Name)}
    if isinstance(node, ast.ClassDef):
        names = {n.id for e in node.decorator_list + node.bases + [k.value for k in node.keywords]
                 for n in ast.walk(e) if isinstance(n, ast.Name)}
        inside, bound = set(), set()
        for stmt in node.body:
            inside |= _names_read_when_defined(stmt) - bound
            bound |= _bound_names(Part("", [], node=stmt))
        return names | inside
    names, todo = set(), [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Lambda):
            continue  # its body runs when it is called
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            names.add(n.id)
        todo.extend(ast.iter_child_nodes(n))
    stored = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names - stored


def _strip_leading_blank(lines: list[str]) -> list[str]:
    i = 0
    while i < len(lines) - 1 and not lines[i].strip():
        i += 1
    return lines[i:]


def _leading_blank(lines: list[str]) -> int:
    return len(lines) - len(_strip_leading_blank(lines))


class ModuleComposer:
    """The parts of one module, grown cell by cell in course order; `render` writes the module's code."""

    def __init__(self, module: str):
        self.module = module
        self.parts: list[Part] = []

    def add_cell(self, source: str, origin: str, where: str) -> None:
        """Add one exported cell (its source already has nbdev's relative imports); `origin` is its marker."""
        lines = source.split("\n")
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            raise ComposeError(f"{where}: does not parse as Python ({e.msg}, line {e.lineno})") from None
        for node, stmt_lines in split_statements(lines, tree.body, 1, len(lines)):
            if _is_patch_import(node, where):
                continue
            if _patch_decorator(node) is not None:
                self._fold(stmt_lines, origin, where)
                continue
            self._add(Part(origin, stmt_lines, _key(node), node), where)

    def _add(self, part: Part, where: str) -> None:
        """Append `part`, or put it in the place of the part it replaces."""
        for i, old in enumerate(self.parts):
            if part.key is not None and old.key == part.key:
                bound = set(dir(builtins)).union(*(_bound_names(p) for p in self.parts[:i]))
                missing = sorted(_names_read_when_defined(part.node) - bound - _bound_names(part))
                if missing:
                    raise ComposeError(f"{where}: {part.key[1]} replaces the definition above it in {self.module}, "
                                       f"but runs {', '.join(missing)} when it is defined, which the module defines "
                                       "only further down; define that above the replaced definition")
                self.parts[i] = part
                return
        self.parts.append(part)

    def _bound_above(self, cls: str) -> set[str]:
        """Names the module binds above class `cls` (all of them if it has no such class)."""
        names = set()
        for part in self.parts:
            if part.key == ("def", cls) and isinstance(part.node, ast.ClassDef):
                break
            names |= _bound_names(part)
        return names

    def _fold(self, stmt_lines: list[str], origin: str, where: str) -> None:
        name, classes, method = fold_patched(stmt_lines, where, self._bound_above)
        for cls in classes:
            owner = next((p for p in self.parts if p.key == ("def", cls) and isinstance(p.node, ast.ClassDef)), None)
            if owner is None:
                raise ComposeError(f"{where}: @patch adds {name} to {cls}, which {self.module} does not define before "
                                   "this cell; a method is folded only into a class of its own module")
            _open_class(owner)
            extra = _member_indent(owner)[len(INDENT):]  # a class body indented by more than four spaces
            member = Part(origin, [""] + [extra + line if line.strip() else line for line in method], ("def", name))
            same = [i for i, m in enumerate(owner.members) if m.key == ("def", name)]
            if len(same) > 1:
                raise ComposeError(f"{where}: {cls} has {len(same)} members named {name} (a property and its "
                                   "setter?); define the class again instead of patching it")
            if same:
                owner.members[same[0]] = member
            else:
                owner.members.append(member)

    def render(self) -> str:
        """The module's code after its `__all__`: every run of parts under the marker of the cell that wrote it."""
        chunks, current = [], None
        for part in self.parts:
            lines, last_origin = _render_part(part)
            if part.origin != current:
                chunks.append("\n\n" + part.origin + "\n" + "\n".join(_strip_leading_blank(lines)))
            else:
                chunks.append("\n" + "\n".join(lines))
            current = last_origin
        return "".join(chunks)


def _open_class(part: Part) -> None:
    """Cut a class statement into its head, its members and its tail, so that methods can be folded into it."""
    if part.members is not None:
        return
    node = ast.parse("\n".join(part.lines)).body[0]
    body_start = _start(node.body[0])
    if body_start == node.lineno:
        raise ComposeError(f"class {node.name} is written on one line; open its body to fold methods into it")
    end = node.body[-1].end_lineno
    part.head = part.lines[:body_start - 1]
    part.members = [Part(part.origin, lines, _key(n), n)
                    for n, lines in split_statements(part.lines, node.body, body_start, end)]
    part.tail = part.lines[end:]


def _member_indent(part: Part) -> str:
    first = next(line for m in part.members for line in m.lines if line.strip() and not line.lstrip().startswith("#"))
    return first[: len(first) - len(first.lstrip())]


def _render_part(part: Part) -> tuple[list[str], str]:
    """A part's lines, with a marker above each class member written by another cell than the lines before it;
    and the origin of its last line."""
    if part.members is None:
        return part.lines, part.origin
    out, running, indent = list(part.head), part.origin, _member_indent(part)
    for member in part.members:
        lines = member.lines
        if member.origin != running:
            blank = _leading_blank(lines) if len(lines) > 1 else 0
            lines = lines[:blank] + [indent + member.origin] + lines[blank:]
            running = member.origin
        out += lines
    return out + part.tail, running
