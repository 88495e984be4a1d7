"""How the exporter composes one module from several notebooks' cells (scripts/compose_modules.py): methods grown
with @patch folded into their class body, later definitions replacing earlier ones in place, and a clear error
for what it cannot place. Each composed module is also run, to show it means what the cells meant."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from compose_modules import ComposeError, ModuleComposer  # noqa: E402

A, B, C = ("# %% ../notebooks/01_a.ipynb #one", "# %% ../notebooks/01_a.ipynb #two", "# %% ../notebooks/02_b.ipynb #three")


def compose(*cells: tuple[str, str]) -> str:
    composer = ModuleComposer("pkg.mod")
    for origin, source in cells:
        composer.add_cell(source, origin, origin.split()[-2] + " cell " + origin.split("#")[-1])
    return composer.render()


def run(code: str) -> dict:
    namespace = {}
    exec(compile(code, "<composed>", "exec"), namespace)
    return namespace


CLASS = '''class Counter:
    """Counts."""

    def __init__(self, start: int = 0):
        self.value = start'''

PATCHES = '''from fastcore.basics import patch


@patch
def add(self: Counter, n: int = 1) -> "Counter":
    """Add n."""
    self.value += n
    return self


@patch(as_prop=True)
def doubled(self: Counter) -> int:
    return 2 * self.value'''


def test_patched_methods_fold_into_the_class_body_in_cell_order():
    code = compose((A, CLASS), (B, PATCHES))
    assert code == f'''

{A}
{CLASS}

    {B}
    def add(self, n: int = 1) -> "Counter":
        """Add n."""
        self.value += n
        return self

    @property
    def doubled(self) -> int:
        return 2 * self.value'''
    assert "patch" not in code and "fastcore" not in code
    assert run(code)["Counter"](3).add(2).doubled == 10


def test_a_later_definition_replaces_the_earlier_one_in_place():
    first = "def greet() -> str:\n    return 'hello'\n\n\ndef shout() -> str:\n    return greet().upper()"
    code = compose((A, first), (C, "def greet() -> str:\n    return 'hi'"))
    assert code == f"\n\n{C}\ndef greet() -> str:\n    return 'hi'\n\n{A}\ndef shout() -> str:\n    return greet().upper()"
    assert run(code)["shout"]() == "HI"


def test_a_later_patch_replaces_a_method_in_place_and_marks_both_cells():
    code = compose((A, CLASS + "\n\n    def get(self) -> int:\n        return self.value\n\n    def name(self):\n"
                        "        return 'c'"),
                   (C, "@patch\ndef get(self: Counter) -> int:\n    return self.value + 100"))
    body = code.split("class Counter:")[1]
    assert body.index(C) < body.index("return self.value + 100") < body.index(A) < body.index("def name")
    assert code.count("def get") == 1 and run(code)["Counter"](1).get() == 101


def test_an_assignment_that_reads_its_name_extends_instead_of_replacing():
    code = compose((A, "TILES = {1: 'a'}"), (C, "TILES = TILES | {2: 'b'}"))
    assert code.count("TILES =") == 2 and run(code)["TILES"] == {1: "a", 2: "b"}
    code = compose((A, "LIMIT = 1"), (C, "LIMIT = 2"))
    assert code.count("LIMIT =") == 1 and run(code)["LIMIT"] == 2


def test_annotations_naming_the_class_or_later_names_are_quoted_and_strings_keep_their_text():
    later = "@patch\ndef merge(self: Counter, other: Counter, spec: Spec) -> Counter:\n" \
            "    text = '''two\nlines'''\n    return self, text"
    code = compose((A, CLASS), (B, later), (C, "class Spec:\n    pass"))
    assert 'def merge(self, other: "Counter", spec: "Spec") -> "Counter":' in code
    assert "        text = '''two\nlines'''" in code  # the literal's second line is not indented
    namespace = run(code)
    assert namespace["Counter"]().merge(None, None)[1] == "two\nlines"


def test_what_cannot_be_placed_is_refused_with_the_fix():
    with pytest.raises(ComposeError, match="Counter, which pkg.mod does not define before this cell"):
        compose((A, PATCHES))
    with pytest.raises(ComposeError, match="may import only `patch` from fastcore.basics"):
        compose((A, "from fastcore.basics import patch, store_attr"))
    with pytest.raises(ComposeError, match="uses timed in a decorator or default value.*define it above the class"):
        compose((A, CLASS), (B, "def timed(f):\n    return f\n\n\n@patch\n@timed\ndef tick(self: Counter):\n    pass"))
    with pytest.raises(ComposeError, match="runs HELPER when it is defined.*define that above the replaced"):
        compose((A, "def f(x=1):\n    return x"), (C, "HELPER = 2\n\n\ndef f(x=HELPER):\n    return x"))
    with pytest.raises(ComposeError, match="needs its class as the annotation of its first argument"):
        compose((A, CLASS), (B, "@patch\ndef bad(self):\n    pass"))
    with pytest.raises(ComposeError, match="does not parse as Python"):
        compose((A, "def broken(:"))
