"""docs/architecture.md's name lists are the code's (blunb.docs writes them) and module docstrings stay short."""

import ast
import re

from blunb import docs

MAX_DOCSTRING_LINES = 15


def test_architecture_doc_is_current():
    text = docs.DOC.read_text(encoding="utf-8")
    assert docs.render(text) == text, (
        f"docs/architecture.md's generated parts (package map, public names) differ from the code: run `{docs.COMMAND}`"
        " and commit the doc"
    )


def test_render_keeps_the_prose_and_fills_the_blocks():
    text = "intro\n<!-- generated: package map -->\nold\n<!-- end generated -->\nmiddle\n" \
           "<!-- generated: public names -->\n<!-- end generated -->\nend\n"
    out = docs.render(text)
    assert out.startswith("intro\n<!-- generated: package map -->\n- `blunb/__init__.py`: blunb: ")
    assert "\nold\n" not in out and "\nmiddle\n" in out and out.endswith("<!-- end generated -->\nend\n")
    assert "- `blunb.optim`: `ClipStats`, `ShardedAdamW`, `ShardedMuon`, `wsd_lr`" in out  # its __all__


def test_module_docstrings_are_short():
    lines = {}
    for path in docs.modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        lines[path.relative_to(docs.PACKAGE.parent).as_posix()] = len(doc.splitlines()) if doc else 0
    long = {name: n for name, n in lines.items() if n > MAX_DOCSTRING_LINES}
    assert not long, (
        f"module docstrings longer than {MAX_DOCSTRING_LINES} lines (say what the module is for and why; details go"
        f" to docs/architecture.md, with a pointer): {long}"
    )


def test_docstring_pointers_name_sections_that_exist():
    text = docs.DOC.read_text(encoding="utf-8")
    headings = set(re.findall(r"^#+ (.+)$", text, re.M))
    missing = {}
    for path in docs.modules():
        doc = " ".join((ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split())
        for section in re.findall(r'docs/architecture\.md, section "([^"]+)"', doc):
            if section not in headings:
                missing[path.relative_to(docs.PACKAGE.parent).as_posix()] = section
    assert not missing, f"docstrings point to sections docs/architecture.md does not have: {missing}"
