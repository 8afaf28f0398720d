"""Cut the Chinese and Japanese characters the book shows out of Noto Sans CJK, for readers
whose machine has no CJK font (without one the browser draws empty boxes).

    apt-get install fonts-noto-cjk          # once, on the machine that runs this script
    .venv/bin/python tools/cjk_font.py      # writes _vendor/fonts/noto-sans-cjk-book.woff

The characters come from the chapters, the pages and references.bib; the subset holds only
those (a few kB, WOFF). `_vendor/book.css` loads it for the CJK code points alone, ahead of the
theme's fonts, so no other character changes. tests/test_project.py fails when a page gains a
CJK character that the subset lacks: run this script again then. Noto Sans CJK is under the
SIL Open Font License 1.1 (_vendor/fonts/LICENSE-noto-cjk.txt).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
SOURCE_FONT_NUMBER = 2  # the collection's Simplified Chinese face ("Noto Sans CJK SC")
OUT = ROOT / "_vendor" / "fonts" / "noto-sans-cjk-book.woff"
# CJK punctuation, kana, unified ideographs, full-width forms: the ranges book.css routes here.
CJK = re.compile("[\u3000-\u30ff\u4e00-\u9fff\uff00-\uffef]")


def book_characters() -> set[str]:
    """Every CJK character of the chapters, the Markdown pages and the bibliography."""
    files = [*sorted((ROOT / "book").glob("*.ipynb")), *sorted((ROOT / "book").glob("*.md")),
             ROOT / "references.bib"]
    return {char for path in files for char in CJK.findall(path.read_text(encoding="utf-8"))}


def main() -> None:
    from fontTools import subset

    if not SOURCE.is_file():
        sys.exit(f"{SOURCE} not found: install Debian's fonts-noto-cjk first")
    chars = book_characters()
    options = subset.Options()
    options.flavor = "woff"
    options.font_number = SOURCE_FONT_NUMBER
    options.layout_features = ["*"]
    font = subset.load_font(str(SOURCE), options)
    subsetter = subset.Subsetter(options)
    subsetter.populate(text="".join(sorted(chars)))
    subsetter.subset(font)
    OUT.parent.mkdir(exist_ok=True)
    subset.save_font(font, str(OUT), options)
    print(f"{OUT.relative_to(ROOT)}: {len(chars)} characters, {OUT.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
