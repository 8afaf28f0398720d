"""Rewrite the Markdown cells of the chapters from MyST into portable Markdown.

    .venv/bin/python tools/portable_markdown.py                        # every book/*.ipynb
    .venv/bin/python tools/portable_markdown.py book/03_attention_forward.ipynb ...

JupyterLab and Colab render CommonMark and `$...$` math only: a MyST role, directive or label
reaches their readers raw. The portable form (docs/CHAPTERS.md, "Portable Markdown") reads the
same in the HTML book, JupyterLab and Colab:

- `$$ ... $$ (eq-label)` becomes `$$ % eq-label ... \\tag{C.k} $$`: numbered per chapter C in order
  of appearance; the label stays as a TeX comment (no reader sees it) so that a later run, on
  another chapter, still resolves references to it;
- {eq}`eq-label` becomes "eq. (C.k)" ("eqs. (C.1) and (C.2)" for a run), with " of [chapter C](file)"
  when the equation is in another chapter;
- {cite}`key` and {cite:p} become "([Vaswani et al., 2017](references.md#key))" (no parentheses
  of their own inside parentheses), {cite:t} "[Vaswani et al. (2017)](references.md#key)", the
  labels as the references page prints them (tools/book_bibliography.py);
- a ```{figure} becomes `![alt](path)` and a line `*Figure C.k: caption*`, {numref} "Figure C.k";
  figures are numbered per chapter in order, the captioned figure outputs of code cells
  (cell metadata `mystnb.figure`) included, as tools/book_portable.py numbers those in the HTML;
- `(label)=` targets go, {ref}`label` becomes a link to the heading they named;
- admonitions become a blockquote with a bold lead, dropdowns `<details><summary>`.

Only Markdown cells change: code cells, outputs and metadata stay byte for byte. A second run
changes nothing. A construct it cannot convert stops it with the notebook and cell named.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from docutils.nodes import make_id
from myst_parser.mdit_to_docutils.base import default_slugify  # the anchors of myst_heading_anchors
from pybtex.database import parse_file
from pybtex.plugin import find_plugin

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import book_bibliography  # noqa: E402  (the references page's labels)

DISPLAY = re.compile(r"\$\$(?P<tex>.+?)\$\$(?P<label>[ \t]*\((?P<eqlabel>[^)\s]+)\))?", re.S)
TAG = re.compile(r"\\tag\{([^}]*)\}")
LABEL_COMMENT = re.compile(r"^[ \t]*%[ \t]*(\S+)[ \t]*$", re.M)
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|:{3,})[ \t]*\{(?P<name>[a-z][\w:-]*)\}[ \t]*(?P<arg>[^\n]*)\n"
    r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.M | re.S,
)
OPTION = re.compile(r"^:(\w[\w-]*):[ \t]*(.*)$")
TARGET = re.compile(r"^\((?P<label>[^)\s]+)\)=[ \t]*\n(?:[ \t]*\n)*(?P<heading>#+[ \t]+(?P<title>[^\n]+))?", re.M)
ROLE = re.compile(r"\{(?P<role>[a-z][a-z:\-]*)\}`(?P<content>[^`]*)`")
EQ_RUN = re.compile(r"\{eq\}`[^`]*`(?:(?:,?[ \t\n]+(?:and|to|or)[ \t\n]+|,[ \t\n]+)\{eq\}`[^`]*`)*")
CAPTION = re.compile(r"^\*Figure (?P<number>[\w.]+): ", re.M)
ADMONITIONS = {"note": "Note", "tip": "Tip", "hint": "Hint", "important": "Important",
               "warning": "Warning", "caution": "Caution", "attention": "Attention",
               "danger": "Danger", "error": "Error", "seealso": "See also"}


def directive_options(body: str) -> tuple[dict[str, str], list[str]]:
    """The `:key: value` lines that open a directive's body, and the lines after them."""
    lines, options = body.splitlines(), {}
    while lines and OPTION.match(lines[0].strip()):
        key, value = OPTION.match(lines[0].strip()).groups()
        options[key] = value
        lines.pop(0)
    return options, lines


def chapter_of(path: Path) -> str | None:
    """'3' for book/03_attention_forward.ipynb; None for a page without a chapter number."""
    match = re.match(r"(\d+)_", path.name)
    return str(int(match.group(1))) if match else None


def number(chapter: str | None, k: int) -> str:
    return f"{chapter}.{k}" if chapter is not None else str(k)


def figure_names(nb) -> list[str | None]:
    """The figures of a notebook in order: the name of each MyST figure directive or captioned
    code-cell output, None for a figure already converted (its caption line)."""
    found = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for match in re.finditer(rf"{FENCE.pattern}|{CAPTION.pattern}", cell.source, re.M | re.S):
                if match.group("fence") is None:
                    found.append(None)
                elif match.group("name") == "figure":
                    found.append(directive_options(match.group("body"))[0].get("name"))
        elif cell.cell_type == "code":
            name = cell.metadata.get("mystnb", {}).get("figure", {}).get("name")
            if name:
                found.append(name)
    return found


@dataclass
class Target:
    """Where a label points: the number a reader sees and the notebook it lives in."""
    text: str
    path: Path
    anchor: str = ""


@dataclass
class Book:
    """Every label of the chapters (equations, figures, section targets) and the citation labels."""
    equations: dict[str, Target] = field(default_factory=dict)
    figures: dict[str, Target] = field(default_factory=dict)
    sections: dict[str, Target] = field(default_factory=dict)
    citations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, paths, bibfile: Path) -> Book:
        book = cls(citations=citation_labels(bibfile))
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            chapter = chapter_of(path)
            k = 0
            for cell in nb.cells:
                if cell.cell_type != "markdown":
                    continue
                for label in numbered_equations(cell.source):
                    k += 1
                    if label:
                        book.equations[label] = Target(number(chapter, k), path)
                for match in TARGET.finditer(cell.source):
                    title = match.group("title") or match.group("label")
                    book.sections[match.group("label")] = Target(title.strip(), path, default_slugify(title))
            for k, name in enumerate(figure_names(nb), start=1):
                if name:
                    book.figures[name] = Target(number(chapter, k), path)
        return book


def numbered_equations(source: str) -> list[str | None]:
    """The label (None if it has none) of each numbered display equation of a Markdown cell:
    MyST `$$ ... $$ (label)`, a converted `\\tag{}` one (its label in a `% label` comment) and a
    labelled {math} directive."""
    found = []
    for match in re.finditer(rf"{FENCE.pattern}|{DISPLAY.pattern}", source, re.M | re.S):
        if match.group("fence"):
            options, _ = directive_options(match.group("body"))
            if match.group("name") == "math" and "label" in options:
                found.append(options["label"])
        elif match.group("eqlabel") or TAG.search(match.group("tex")):
            comment = LABEL_COMMENT.search(match.group("tex"))
            found.append(match.group("eqlabel") or (comment.group(1) if comment else None))
    return found


@functools.cache
def citation_labels(bibfile: Path) -> dict[str, str]:
    """Each BibTeX key with the label the references page prints for it: 'Ba et al., 2016'."""
    sorting = find_plugin("pybtex.style.sorting", book_bibliography.AuthorYearStyle.default_sorting_style)
    entries = sorting().sort(parse_file(bibfile).entries.values())
    labels = book_bibliography.AuthorYearLabels().format_labels(entries)
    return {entry.key: label for entry, label in zip(entries, labels)}


class ConversionError(ValueError):
    """A construct without a portable form, or a reference to nothing; names notebook and cell."""


class Converter:
    """Converts the Markdown of one notebook; `changes` counts what it rewrote."""

    def __init__(self, book: Book, path: Path):
        self.book, self.path = book, path
        self.changes: dict[str, int] = {}
        self.where = ""

    def count(self, what: str) -> None:
        self.changes[what] = self.changes.get(what, 0) + 1

    def fail(self, message: str):
        raise ConversionError(f"{self.path.name} {self.where}: {message}")

    def other_chapter(self, target: Target) -> str:
        """' of [chapter 3](03_attention_forward.ipynb)' for a target outside this notebook."""
        if target.path.resolve() == self.path.resolve():
            return ""
        name = chapter_of(target.path)
        title = f"chapter {name}" if name is not None else target.path.stem.replace("_", " ")
        return f" of [{title}]({target.path.name})"

    # --- equations -------------------------------------------------------------------------
    def display(self, source: str) -> str:
        def tag(match):
            label = match.group("eqlabel")
            if not label:
                return match.group(0)
            target = self.book.equations[label]
            self.count("numbered equations")
            return f"$$\n% {label}\n{match.group('tex').strip()}\n\\tag{{{target.text}}}\n$$"
        return DISPLAY.sub(tag, source)

    def eq_run(self, match) -> str:
        labels = re.findall(r"\{eq\}`([^`]*)`", match.group(0))
        joins = re.split(r"\{eq\}`[^`]*`", match.group(0))[1:-1]
        targets = []
        for label in labels:
            if label not in self.book.equations:
                self.fail(f"{{eq}}`{label}` names no equation in the book")
            targets.append(self.book.equations[label])
            self.count("equation references")
        same = {self.other_chapter(t) for t in targets}
        if len(same) == 1:
            parts = [f"({t.text})" for t in targets]
            tail = same.pop()
        else:
            parts = [f"({t.text}){self.other_chapter(t)}" for t in targets]
            tail = ""
        text = parts[0] + "".join(join + part for join, part in zip(joins, parts[1:])) + tail
        before = match.string[: match.start()]
        if re.search(r"(\beqs?\.|[Ee]quations?)\s*$", before):
            return text
        return ("eqs. " if len(targets) > 1 else "eq. ") + text

    # --- citations, figures, sections -----------------------------------------------------
    def cite(self, role: str, content: str, before: str) -> str:
        keys = [key.strip() for key in content.split(",") if key.strip()]
        missing = [key for key in keys if key not in self.book.citations]
        if missing:
            self.fail(f"cited keys missing from references.bib: {', '.join(missing)}")
        self.count("citations")
        links = []
        for key in keys:
            label = self.book.citations[key]
            if role == "cite:t":
                who, year = label.rsplit(", ", 1)
                label = f"{who} ({year})"
            links.append(f"[{label}](references.md#{make_id(key)})")
        if role == "cite:t":
            return links[0] if len(links) == 1 else ", ".join(links[:-1]) + " and " + links[-1]
        paragraph = re.sub(r"\$[^$]*\$|`[^`]*`", "", before.rsplit("\n\n", 1)[-1])  # prose only
        inside = paragraph.count("(") > paragraph.count(")")
        return "; ".join(links) if inside or role == "cite:alp" else "(" + "; ".join(links) + ")"

    def role(self, match) -> str:
        role, content = match.group("role"), match.group("content")
        if role in ("cite", "cite:p", "cite:t", "cite:alp"):
            return self.cite(role, content, match.string[: match.start()])
        explicit = re.fullmatch(r"(.*?)\s*<([^>]+)>", content, re.S)  # {ref}`text <label>`
        text, label = explicit.groups() if explicit else (None, content)
        if role == "numref":
            if label not in self.book.figures:
                self.fail(f"{{numref}}`{label}` names no figure in the book")
            target = self.book.figures[label]
            self.count("figure references")
            shown = text.replace("%s", target.text) if text else f"Figure {target.text}"
            return shown + self.other_chapter(target)
        if role == "ref":
            if label not in self.book.sections:
                self.fail(f"{{ref}}`{label}` names no section target in the book")
            target = self.book.sections[label]
            self.count("section links")
            file = "" if target.path.resolve() == self.path.resolve() else target.path.name
            return f"[{text or target.text}]({file}#{target.anchor})"
        if role == "math":
            self.count("inline math")
            return f"${content}$"
        self.fail(f"no portable form for the role {{{role}}}")

    def fence(self, match) -> str:
        name, arg, body, indent = match.group("name"), match.group("arg").strip(), match.group("body"), match.group("indent")
        options, lines = directive_options(body)
        content = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines).strip()
        if name == "figure":
            self.count("figures")
            target = self.book.figures.get(options.get("name", ""))
            if target is None:
                self.fail(f"a figure without a :name: cannot be numbered ({arg})")
            alt = re.sub(r"([\[\]])", r"\\\1", options.get("alt", content))
            caption = " ".join(content.split())
            out = f"![{alt}]({arg})\n\n*Figure {target.text}: {caption}*"
        elif name in ("dropdown", "toggle"):
            self.count("dropdowns")
            out = f"<details>\n<summary>{arg or 'Show'}</summary>\n\n{content}\n\n</details>"
        elif name in ADMONITIONS or name == "admonition":
            self.count("admonitions")
            lead = arg if name == "admonition" else ADMONITIONS[name]
            out = "\n".join(f"> {line}".rstrip() for line in f"**{lead}.** {content}".splitlines())
        elif name == "math":
            label = options.get("label")
            self.count("numbered equations" if label else "display math")
            tag = f"\n\\tag{{{self.book.equations[label].text}}}" if label else ""
            out = f"$$\n% {label}\n{content}{tag}\n$$" if label else f"$$\n{content}\n$$"
        else:
            self.fail(f"no portable form for the directive {{{name}}}")
        return "\n".join(indent + line if line else line for line in out.splitlines())

    def markdown(self, source: str) -> str:
        source = FENCE.sub(self.fence, source)
        source = self.display(source)

        def target(match):
            self.count("section targets")
            return match.group("heading") or ""
        source = TARGET.sub(target, source)
        source = EQ_RUN.sub(self.eq_run, source)
        return ROLE.sub(self.role, source)


def converted(path: Path, book: Book) -> tuple[str, dict[str, int]]:
    """The notebook's file text with its Markdown cells converted, and what changed, by kind."""
    nb = nbformat.read(path, as_version=4)
    converter = Converter(book, path)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            converter.where = f"cell {i}"
            cell.source = converter.markdown(cell.source)
    return nbformat.writes(nb) + "\n", converter.changes


def convert(path: Path, book: Book) -> dict[str, int]:
    """Rewrite one notebook's Markdown cells in place; returns what changed, by kind."""
    text, changes = converted(path, book)
    if text != path.read_text(encoding="utf-8"):
        path.write_text(text, encoding="utf-8")
    return changes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every book/*.ipynb")
    parser.add_argument("--bib", type=Path, default=ROOT / "references.bib")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(BOOK.glob("*.ipynb"))
    missing = [str(p) for p in paths if not p.is_file() or p.suffix != ".ipynb"]
    if missing:
        print(f"error: not a notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    every = sorted({*BOOK.glob("*.ipynb"), *paths}, key=lambda p: p.name)
    book = Book.read(every, args.bib)
    try:  # every notebook converts, or none is written
        results = [(path, *converted(path, book)) for path in paths]
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path, text, changes in results:
        if text != path.read_text(encoding="utf-8"):
            path.write_text(text, encoding="utf-8")
        summary = ", ".join(f"{n} {what}" for what, n in sorted(changes.items())) or "nothing to change"
        print(f"{path}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
