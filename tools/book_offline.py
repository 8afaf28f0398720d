"""Sphinx extension (loaded through `sphinx.local_extensions` in _config.yml): light, offline pages
that load only the JavaScript they use.

- No CDN stylesheet for Font Awesome. matplotlib's `Animation.to_jshtml()` output, which the
  chapters store for kernel-less animations, links Font Awesome 4 from a CDN for the icons of its
  play/step buttons: a request to a third party, and offline a render-blocking stylesheet.
- No Font Awesome script. The theme loads a 1.5 MB script (`scripts/fontawesome.js`, every icon
  of Font Awesome 6 as SVG) that only redraws icons its own stylesheet already draws from the Font
  Awesome web font (156 kB): the icons of its buttons, and the `fa fa-play`-style buttons of the
  animations.
- Sphinx's search index and tools only on the search page (the search box sends its query there;
  search-as-you-type is off), sphinx-design's stylesheet and script only where a page uses it.
- No sphinx-thebe script or stylesheet: live code is off (`launch_buttons.thebe: false`), and
  jupyter-book 1.0 with Sphinx 7.4 emits sphinx-thebe's inline configuration twice, whose second
  copy throws "Identifier 'THEBE_JS_URL' has already been declared" on every page.
- Alt text for the frames of matplotlib animations: the `<img>` that `to_jshtml()` writes has none;
  it gets the cell's `mystnb.image.alt`, the key myst-nb reads for the alt text of image outputs.
- The widget manager (`nb_ipywidgets_js`, 1.9 MB) and the stored widget state only on pages that
  still show a widget: a notebook saved with widget state keeps it in its metadata even where its
  widget outputs are removed from the HTML (tag `remove-output`).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from docutils import nodes

# <link rel="stylesheet" href="https://.../font-awesome.min.css"> in any attribute order/spacing.
CDN_FONT_AWESOME = re.compile(
    r"""<link\b(?=[^>]*\brel=["']?stylesheet)(?=[^>]*\bhref=["']?https?://[^"'>\s]*font-awesome[^"'>\s]*\.css)[^>]*>""",
    re.IGNORECASE,
)
# Scripts the theme's templates write into every page and the book does not use there: the Font
# Awesome script, and (search-as-you-type being off) Sphinx's search tools and search index, which
# only the search page needs: the search box sends its query there.
UNUSED_THEME_SCRIPTS = ("_static/scripts/fontawesome.js", "_static/searchtools.js", "_static/language_data.js", "searchindex.js")
UNUSED_ON_SEARCH_PAGE = UNUSED_THEME_SCRIPTS[:1]

# sphinx-thebe's per-page configuration, written into the page body.
THEBE_CONFIG = re.compile(r"""<script type="text/x-thebe-config">.*?</script>\s*""", re.DOTALL)

# The frame of a matplotlib animation (`Animation.to_jshtml()`): <img id="_anim_img<hex>">.
ANIMATION_FRAME = re.compile(r'<img id="_anim_img\w+"')

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _script_tags(paths) -> re.Pattern:
    """<script ... src="(../)*PATH(?query)"></script> for each of `paths`, with its line break."""
    names = "|".join(re.escape(path) for path in paths)
    return re.compile(rf"""[ \t]*<script\b[^>]*\bsrc="(?:\.\./)*(?:{names})(?:\?[^"]*)?"[^>]*>\s*</script>\n?""")


def strip_cdn_font_awesome(html: str) -> str:
    return CDN_FONT_AWESOME.sub("", html)


def _is_thebe(asset) -> bool:
    return str(asset.filename or "").split("/")[-1] in ("sphinx-thebe.js", "sphinx-thebe.css") or (
        "THEBE_JS_URL" in asset.attributes.get("body", ""))


def _is_widget_manager(script, manager_files) -> bool:
    return script.filename in manager_files or script.attributes.get("type") == WIDGET_STATE


def _describe_animation_frames(app, doctree, docname):
    """Give the frame <img> of each animation the alt text of its cell (`mystnb.image.alt`)."""
    for cell in doctree.findall(lambda node: isinstance(node, nodes.container) and node.get("nb_element") == "cell_code"):
        alt = ((cell.get("cell_metadata") or {}).get("mystnb") or {}).get("image", {}).get("alt")
        if not alt:
            continue
        for raw in list(cell.findall(nodes.raw)):
            text = raw.astext()
            if ANIMATION_FRAME.search(text):
                described = ANIMATION_FRAME.sub(lambda match: f'{match.group(0)} alt="{html.escape(alt)}"', text)
                raw.replace_self(nodes.raw("", described, format=raw["format"]))


def _on_page(app, pagename, templatename, context, doctree):
    body = context.get("body", "")  # none on the pages Sphinx writes from templates (search, index)
    if body:
        body = context["body"] = THEBE_CONFIG.sub("", strip_cdn_font_awesome(body))
    manager_files = {f"_static/{path}" for path in app.config.nb_ipywidgets_js}  # as add_js_file stores them
    shows_widgets = WIDGET_VIEW in body
    context["script_files"] = [
        script
        for script in context.get("script_files", [])
        if not _is_thebe(script) and (shows_widgets or not _is_widget_manager(script, manager_files))
    ]
    context["css_files"] = [css for css in context.get("css_files", []) if not _is_thebe(css)]
    if "sd-" not in body:  # no sphinx-design component (card, tab, grid) on this page
        context["script_files"] = [s for s in context["script_files"] if not str(s.filename).endswith("design-tabs.js")]
        context["css_files"] = [c for c in context["css_files"] if not str(c.filename).endswith("sphinx-design.min.css")]


def _drop_unused_theme_scripts(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    unused = _script_tags(UNUSED_THEME_SCRIPTS)
    unused_on_search_page = _script_tags(UNUSED_ON_SEARCH_PAGE)
    for page in Path(app.outdir).rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        lighter = (unused_on_search_page if page.name == "search.html" else unused).sub("", html)
        if lighter != html:
            page.write_text(lighter, encoding="utf-8")


def setup(app):
    app.connect("doctree-resolved", _describe_animation_frames)
    app.connect("html-page-context", _on_page, priority=900)  # after myst-nb adds its scripts
    app.connect("build-finished", _drop_unused_theme_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
