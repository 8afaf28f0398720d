"""Sphinx extension (loaded through `sphinx.local_extensions` in _config.yml): the bibliography
labels its entries the way the text cites them.

The chapters cite author-year, "(Ba et al., 2016)" (`bibtex_reference_style: author_year`), but
pybtex's default formatting style labels the list on the references page `[BKH16]`, so a reader
cannot find the one in the other. The style registered here, `authoryear`, is pybtex's `unsrt`
formatting (entries sorted by author, year and title) with labels built like the citations: one
author "Ba, 2016", two "Ba and Kiros, 2016", more "Ba et al., 2016", and, for the sources that
name no author, the title. Two entries that would share a label get "2016a",
"2016b".
"""

from __future__ import annotations

from collections import Counter

from pybtex.plugin import find_plugin, register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle

NAME = "authoryear"
TEXT = find_plugin("pybtex.backends", "text")()  # found once: each lookup scans the entry points


def _plain(latex: str) -> str:
    """BibTeX text as a reader sees it: braces and accents resolved."""
    return Text.from_latex(latex).render(TEXT)


def _who(entry) -> str:
    """'Ba', 'Ba and Kiros' or 'Ba et al.'; the title when there is no author (as the text cites)."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    last = [_plain(" ".join(person.prelast_names + person.last_names)) for person in people]
    if not last:
        return _plain(entry.fields["title"])
    if len(last) == 1:
        return last[0]
    return f"{last[0]} and {last[1]}" if len(last) == 2 else f"{last[0]} et al."


class AuthorYearLabels(BaseLabelStyle):
    """Labels as the text cites: 'Ba et al., 2016'."""

    def format_labels(self, sorted_entries):
        entries = list(sorted_entries)
        labels = [f"{_who(e)}, {e.fields.get('year', 'n.d.')}" for e in entries]
        counts, seen = Counter(labels), Counter()
        for label in labels:
            if counts[label] > 1:
                seen[label] += 1
                label += "abcdefghijklmnopqrstuvwxyz"[seen[label] - 1]
            yield label


class AuthorYearStyle(UnsrtStyle):
    default_label_style = NAME
    default_sorting_style = "author_year_title"


def setup(app):
    register_plugin("pybtex.style.labels", NAME, AuthorYearLabels)
    register_plugin("pybtex.style.formatting", NAME, AuthorYearStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
