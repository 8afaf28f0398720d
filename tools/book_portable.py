"""Sphinx extension (loaded through `sphinx.local_extensions` in _config.yml): the HTML book
reads the chapters' portable Markdown (tools/portable_markdown.py) as the reader expects.

- A display equation numbered by `\\tag{3.2}` is handed to MathJax as it stands. Sphinx wraps a
  display equation that contains `\\\\` in `\\begin{split}`, where MathJax refuses a `\\tag`.
- Citation links `[Ba et al., 2016](references.md#ba2016layer)` hit their entry: the references
  page's entries carry their BibTeX key as id (`bibtex_cite_id: "{key}"` in _config.yml), and
  each key is made a target of that page, so MyST resolves the link instead of warning.
- Figures are numbered per chapter, "Figure 3.2", in the order tools/portable_markdown.py counts
  them (the Markdown figures, whose captions carry their number, and the captioned figure outputs
  of code cells), instead of through the whole book.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from docutils import nodes

from portable_markdown import chapter_of, figure_names


def pass_tagged_math(app, doctree) -> None:
    """Display math with a `\\tag` goes to MathJax unwrapped, between `\\[` and `\\]`."""
    for node in doctree.findall(nodes.math_block):
        tex = node.astext()
        if "\\tag{" in tex and not node.get("nowrap"):
            node["nowrap"] = True
            node.children = [nodes.Text(f"\\[\n{tex}\n\\]")]


def bibliography_targets(app, doctree) -> None:
    """Every entry of a bibliography on this page becomes a link target `page.md#key`."""
    docname = app.env.docname
    slugs = app.env.metadata[docname].setdefault("myst_slugs", {})
    for key, bibliography in app.env.get_domain("cite").bibliographies.items():
        if key.docname != docname:
            continue
        for bibkey, citation in bibliography.citation_nodes.items():
            if citation["ids"]:
                slugs[citation["ids"][0]] = (1, citation["ids"][0], bibkey)


def number_figures_per_chapter(app, env) -> list[str]:
    """Figure k of chapter C is numbered (C, k), of a page without a chapter number (k,): rewrite
    the book-wide numbers Sphinx assigned."""
    changed = []
    for docname, numbers in env.toc_fignumbers.items():
        chapter = chapter_of(Path(docname))
        figures = numbers.get("figure")
        if not figures:
            continue
        names = figure_names(nbformat.read(env.doc2path(docname), as_version=4))
        position = {nodes.make_id(name): k for k, name in enumerate(names, start=1) if name}
        unknown = sorted(set(figures) - set(position))
        if unknown:
            raise ValueError(f"{docname}: figures without a `mystnb.figure.name`: {unknown}")
        for node_id in figures:
            figures[node_id] = (int(chapter), position[node_id]) if chapter else (position[node_id],)
        changed.append(docname)
    return changed


def setup(app):
    app.connect("doctree-read", pass_tagged_math)
    app.connect("doctree-read", bibliography_targets)
    app.connect("env-get-updated", number_figures_per_chapter, priority=900)  # after Sphinx's
    return {"parallel_read_safe": True, "parallel_write_safe": True}
