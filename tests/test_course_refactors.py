"""A lesson that refactors an earlier lesson's code shows the code before and after (design.md, "Build, then
refactor"). Its "before" cell carries the tag `before:<earlier notebook>` and defines the earlier code again, under
the same names; this test checks that each definition there is the earlier lesson's, statement for statement
(docstrings aside), so a change to the earlier lesson cannot leave a stale "before" behind."""
import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def cells(name: str) -> list[dict]:
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"]


def source(cell: dict) -> str:
    text = "".join(cell["source"])
    return "\n".join("" if line.lstrip().startswith(("%", "!", "#|")) else line for line in text.splitlines())


def without_docstring(node: ast.AST) -> str:
    """The definition's AST without its docstring, its decorators and its annotations' spelling of `self`."""
    node = ast.parse(ast.unparse(node)).body[0]  # a copy
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]
    node.decorator_list = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
        node.args.args[0].annotation = None  # `self: LLMEngine` (a @patch) and `self` (a class body) are the same
    return ast.dump(node)


def definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level functions and classes, and methods as `Class.method`: in a class body, or grown with `@patch`
    (`def step(self: LLMEngine)`), so a class and a function of one name never stand for each other."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            found[node.name] = node
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = item
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            patched = any(ast.unparse(d).startswith("patch") for d in node.decorator_list)
            owner = node.args.args[0].annotation if patched and node.args.args else None
            found[f"{ast.unparse(owner).strip(chr(34))}.{node.name}" if owner is not None else node.name] = node
    return found


BEFORE_CELLS = [(nb.stem, cell.get("id"), tag.split(":", 1)[1])
                for nb in sorted(NOTEBOOKS.glob("*.ipynb")) for cell in cells(nb.stem)
                for tag in cell.get("metadata", {}).get("tags", []) if tag.startswith("before:")]


def test_refactor_lessons_show_their_before_code():
    assert {lesson for lesson, _, _ in BEFORE_CELLS} >= {"13_async_scheduling"}


@pytest.mark.parametrize("lesson,cell_id,earlier", BEFORE_CELLS)
def test_before_cell_is_the_earlier_lessons_code(lesson, cell_id, earlier):
    assert earlier < lesson, f"{lesson} cell {cell_id}: 'before' names {earlier}, which is not an earlier lesson"
    before = definitions(ast.parse(source(next(c for c in cells(lesson) if c.get("id") == cell_id))))
    assert before, f"{lesson} cell {cell_id} defines nothing"
    written = {}
    for cell in cells(earlier):
        if cell["cell_type"] == "code" and "".join(cell["source"]).startswith("#| export"):
            written.update(definitions(ast.parse(source(cell))))
    for name, node in before.items():
        if name not in written:  # a method shown as a plain function: the one method of that name
            owners = [key for key in written if key.endswith(f".{name}")]
            name = owners[0] if len(owners) == 1 else name
        assert name in written, f"{lesson} cell {cell_id} shows {name} as {earlier}'s, which does not define it"
        assert without_docstring(node) == without_docstring(written[name]), \
            f"{lesson} cell {cell_id}: {name} is no longer {earlier}'s code; copy it again from {earlier}"
