"""What the two browser checks share: where Chromium is, where screenshots go, what is prose.

tests/test_book_browser.py opens the built HTML book, tests/test_jupyterlab.py the chapters in a
real JupyterLab; both in headless Chromium (Debian's `chromium`, or GPTLAB_CHROMIUM).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "_build" / "screenshots"


def _find_chromium() -> str | None:
    candidates = [os.environ.get("GPTLAB_CHROMIUM"), "/usr/bin/chromium"]
    candidates += [shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


CHROMIUM = _find_chromium()

# Text a reader does not see as prose: code, scripts, and what MathJax produced.
NOT_PROSE = {"script", "style", "pre", "code", "kbd", "samp", "textarea", "noscript", "template", "svg", "math", "head", "title"}

# TeX that MathJax should have typeset: left in the visible text, it was not.
RAW_MATH = [r"$$", r"\begin{", r"\(", r"\["]
