"""Regenerates docs/architecture.md's name lists from the code: `python -m blunb.docs` (`--check`: exit 1 if stale).

Those parts are the package map (every module of blunb/ with the first line of its docstring, "..." where
its first paragraph goes on) and the
public names per module (its `__all__`, else its public top-level functions and classes), each between a
`<!-- generated: <part> -->` and an `<!-- end generated -->` line; the prose around them is left as it is.
The modules are read with ast, never imported, so this runs without torch or a GPU and imports no kernel.
It lives in the package (not tools/) so `python -m` finds it from any directory and the test imports it.
tests/test_architecture_doc.py fails when the committed doc differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "architecture.md"
COMMAND = "python -m blunb.docs"
END = "<!-- end generated -->"
_BLOCK = re.compile(r"(<!-- generated: (?P<part>[a-z ]+?) -->\n)(?P<body>.*?)(" + re.escape(END) + ")", re.S)


def modules() -> list[Path]:
    """Every .py file of the package, sorted by path (a package's __init__.py first)."""
    files = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: (p.parent.relative_to(PACKAGE).parts, p.name != "__init__.py", p.name))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def public_names(path: Path) -> list[str]:
    """The module's `__all__` (a literal list or tuple), else its public top-level functions and classes."""
    tree = _tree(path)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return list(ast.literal_eval(node.value))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [n.name for n in tree.body if isinstance(n, kinds) and not n.name.startswith("_")]


def first_line(path: Path) -> str:
    """The docstring's first line, with " ..." where its first paragraph goes on."""
    lines = (ast.get_docstring(_tree(path)) or "(no docstring)").splitlines()
    return lines[0].rstrip() + (" ..." if len(lines) > 1 and lines[1].strip() else "")


def package_map() -> str:
    return "".join(f"- `{_rel(path)}`: {first_line(path)}\n" for path in modules())


def public_api() -> str:
    lines = []
    for path in modules():
        names = public_names(path)
        if not names:
            continue
        module = _rel(path).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        text = f"- `{module}`: " + ", ".join(f"`{n}`" for n in names)
        lines += textwrap.wrap(text, 120, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines) + "\n"


PARTS = {"package map": package_map, "public names": public_api}


def render(text: str) -> str:
    """`text` with every generated block rewritten from the code; an unknown block name is an error."""
    def fill(m: re.Match) -> str:
        part = m.group("part")
        if part not in PARTS:
            raise ValueError(f"docs/architecture.md: unknown generated block {part!r} (known: {', '.join(PARTS)})")
        return m.group(1) + PARTS[part]() + m.group(4)

    out, n = _BLOCK.subn(fill, text)
    if n != len(PARTS):
        raise ValueError(f"docs/architecture.md: expected {len(PARTS)} generated blocks, found {n}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the doc is not current")
    args = ap.parse_args(argv)
    old = DOC.read_text(encoding="utf-8")
    new = render(old)
    if args.check:
        if new != old:
            print(f"{_rel(DOC)} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        DOC.write_text(new, encoding="utf-8")
        print(f"rewrote {_rel(DOC)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
