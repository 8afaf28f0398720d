"""Sphinx extension (loaded through `sphinx.local_extensions` in _config.yml): no CDN stylesheet
for Font Awesome in the book's pages.

matplotlib's `Animation.to_jshtml()` output, which the chapters store for kernel-less
animations, links Font Awesome 4 from a CDN for the icons of its play/step buttons. The book's
theme already ships Font Awesome 6, whose script turns those `fa fa-play`-style icons into inline
SVG, so the link only costs a request to a third party, and offline a render-blocking stylesheet
that may hang on a network that drops packets. This removes it from the rendered page bodies.
"""

from __future__ import annotations

import re

# <link rel="stylesheet" href="https://.../font-awesome.min.css"> in any attribute order/spacing.
CDN_FONT_AWESOME = re.compile(
    r"""<link\b(?=[^>]*\brel=["']?stylesheet)(?=[^>]*\bhref=["']?https?://[^"'>\s]*font-awesome[^"'>\s]*\.css)[^>]*>""",
    re.IGNORECASE,
)


def strip_cdn_font_awesome(html: str) -> str:
    return CDN_FONT_AWESOME.sub("", html)


def _on_page(app, pagename, templatename, context, doctree):
    if "body" in context:
        context["body"] = strip_cdn_font_awesome(context["body"])


def setup(app):
    app.connect("html-page-context", _on_page)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
