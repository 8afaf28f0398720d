"""Sphinx extension (loaded through `sphinx.local_extensions` in _config.yml): lighter pages.

Run when the HTML build has finished, on the files every page downloads:

- Figures as palette PNGs. matplotlib stores its figures as 24-bit RGBA PNGs, yet a line plot or
  a heatmap uses a few hundred colours. Each `_images/*.png` is re-encoded with a 256-colour
  palette (median cut, no dithering) where that is lighter and looks the same: the mean error is
  under 0.5 levels of 255 and at most 2% of the pixels (the edges of anti-aliased lines, the
  finest steps of a colour map) are off by more than 8 levels. The book's 79 figures go from
  7.6 MB to 2.8 MB.
- The theme's stylesheet without the rules no page can use. It carries all of Bootstrap 5 and a
  rule for each of Font Awesome's 1,900 icon names. A rule whose selectors are all plain classes
  (`.mt-sm-3`, `.fa-bars:before`) is dropped when none of its classes is named anywhere in a page
  or in a script that a page loads (scripts add classes too): such a rule matches no element.
  That is 0.40 MB down to about 0.19 MB.
- Only the Font Awesome glyphs left. The theme draws its icons from the Font Awesome 6 solid web
  font (156 kB, about 1,400 glyphs); the font is cut down to the icons whose rules are left
  (a few kB, as WOFF).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
from fontTools import subset
from PIL import Image

THEME_CSS = "_static/styles/pydata-sphinx-theme.css"
SOLID_FONT = "_static/vendor/fontawesome/webfonts/fa-solid-900"  # .ttf and .woff2
BOOK_FONT = "_static/vendor/fontawesome/webfonts/fa-solid-900-book.woff"

# A style rule (not an @-rule) of the minified stylesheet: it follows a "}" or an @media's "{".
STYLE_RULE = re.compile(r"(?<=[{}])([^{}@]+)\{[^{}]*\}")
# One selector that is a plain class, with pseudo-classes or a pseudo-element: `.fa-bars:before`.
CLASS_SELECTOR = re.compile(r"\s*\.([\w-]+)(?::{1,2}[\w-]+(?:\([^()]*\))?)*\s*")
EMPTY_BLOCK = re.compile(r"@(?:media|supports)[^{}]*\{\}")
NAME = re.compile(r"[A-Za-z_][\w-]*")
# An icon rule that is left: `.fa-bars:before,.fa-navicon:before{content:"\f0c9"}`, or a
# character the CSS way: "K", "\@", "\30 ".
ICON_RULE = re.compile(r'(?:\.fa-[a-z0-9-]+:before,?)+\{content:"(\\[0-9a-f]+ ?|\\.|.)"\}')
SCRIPT_SRC = re.compile(r'<script\b[^>]*\bsrc="([^"?#]+)')
# The @font-face of the solid font: Font Awesome 6 Free, weight 900.
SOLID_FACE_SRC = re.compile(r"(@font-face\{[^}]*font-weight:900;src:)[^}]*(\})")

MAX_MEAN_ERROR = 0.5  # mean absolute difference, in levels of 255, over pixels and channels
VISIBLE_ERROR = 8  # levels of 255 in any channel
MAX_SHARE_VISIBLE = 0.02  # of the pixels


def palette_png(data: bytes) -> bytes | None:
    """The figure as a 256-colour PNG, or None where that is not lighter or not faithful."""
    image = Image.open(io.BytesIO(data))
    if image.mode == "P":
        return None
    rgba = np.asarray(image.convert("RGBA"))
    if rgba[..., 3].min() < 255:  # transparency: median cut works on RGB only
        return None
    rgb = Image.fromarray(rgba[..., :3])
    palette = rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    error = np.abs(np.asarray(palette.convert("RGB"), dtype=np.int16) - np.asarray(rgb, dtype=np.int16))
    if error.mean() > MAX_MEAN_ERROR or (error.max(axis=-1) > VISIBLE_ERROR).mean() > MAX_SHARE_VISIBLE:
        return None
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(data) else None


def lighten_figures(outdir: Path) -> None:
    for png in sorted((outdir / "_images").glob("*.png")):
        lighter = palette_png(png.read_bytes())
        if lighter is not None:
            png.write_bytes(lighter)


def names_in_use(outdir: Path) -> set[str]:
    """Every name-like word in a page of the build or in a script that a page loads."""
    pages = sorted(outdir.rglob("*.html"))
    scripts = {
        (page.parent / src).resolve()
        for page in pages
        for src in SCRIPT_SRC.findall(page.read_text(encoding="utf-8"))
        if "://" not in src
    }
    names: set[str] = set()
    for path in [*pages, *sorted(scripts)]:
        if path.is_file():
            names.update(NAME.findall(path.read_text(encoding="utf-8", errors="replace")))
    return names


def drop_unused_rules(css: str, names: set[str]) -> str:
    """The stylesheet without the rules of plain classes that no page or script names."""

    def keep_if_used(rule: re.Match) -> str:
        classes = [CLASS_SELECTOR.fullmatch(selector) for selector in rule.group(1).split(",")]
        if all(classes) and names.isdisjoint(match.group(1) for match in classes):
            return ""
        return rule.group(0)

    css = STYLE_RULE.sub(keep_if_used, css)
    while EMPTY_BLOCK.search(css):  # an @media left empty, then one around it
        css = EMPTY_BLOCK.sub("", css)
    return css


def _css_character(content: str) -> int:
    r"""The code point of a one-character CSS string: `\f0c9`, `\30 `, `\@` or `K`."""
    if re.fullmatch(r"\\[0-9a-f]+ ?", content):
        return int(content[1:], 16)
    return ord(content[-1])


def subset_icon_font(outdir: Path, css: str) -> str:
    """Write the solid icon font with just the glyphs of `css`'s icon rules; point `css` at it."""
    options = subset.Options()
    options.flavor = "woff"  # zlib; WOFF2 would need brotli
    font = subset.load_font(str(outdir / f"{SOLID_FONT}.ttf"), options)
    subsetter = subset.Subsetter(options)
    subsetter.populate(unicodes=sorted({_css_character(content) for content in ICON_RULE.findall(css)}))
    subsetter.subset(font)
    subset.save_font(font, str(outdir / BOOK_FONT), options)
    font_url = Path(BOOK_FONT).relative_to(Path(THEME_CSS).parent.parent).as_posix()
    css, faces = SOLID_FACE_SRC.subn(rf'\1url(../{font_url}) format("woff")\2', css)
    if faces != 1:
        raise RuntimeError(f"{THEME_CSS}: expected one @font-face of the solid font, found {faces}")
    return css


def trim_theme(outdir: Path) -> None:
    css_path = outdir / THEME_CSS
    if not css_path.is_file():
        return
    css = drop_unused_rules(css_path.read_text(encoding="utf-8"), names_in_use(outdir))
    css_path.write_text(subset_icon_font(outdir, css), encoding="utf-8")


def _lighten(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    lighten_figures(outdir)
    trim_theme(outdir)


def setup(app):
    # After book_offline has taken the scripts that no page uses out of the pages: the names of
    # Font Awesome's script would otherwise keep every icon.
    app.connect("build-finished", _lighten, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
