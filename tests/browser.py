"""What the two browser checks share: where Chromium is, where screenshots go, what is prose.

tests/test_book_browser.py opens the built HTML book, tests/test_jupyterlab.py the chapters in a
real JupyterLab; both in headless Chromium (Debian's `chromium`, or GPTLAB_CHROMIUM).
"""

from __future__ import annotations

import os
import re
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

# Chromium flags for both checks: no sandbox (containers), and offline: no host name resolves
# except the local server's address.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]

# TeX that MathJax should have typeset, as a pattern: the markers above, and a TeX command left
# in the prose (`\mathbf{x}`, `\frac`), which is what math MyST did not recognise shows.
TEX_COMMANDS = ("mathbf", "mathrm", "mathcal", "boldsymbol", "operatorname", "text", "frac", "sqrt", "sum",
                "prod", "left", "right", "cdot", "times", "top", "partial", "nabla", "odot", "otimes", "log",
                "exp", "alpha", "beta", "gamma", "sigma", "theta", "omega", "mu", "tau", "approx", "le", "ge")
RAW_TEX = re.compile("|".join(re.escape(raw) for raw in RAW_MATH) + rf"|\\(?:{'|'.join(TEX_COMMANDS)})(?![a-zA-Z])")

# Run in a book page once MathJax has typeset it: opens every <details> (exercise solutions,
# hidden code cells), then measures what a reader at this window width sees. Widths are compared
# with one pixel of slack for sub-pixel rounding.
AUDIT_JS = r"""notProse => {
    const article = document.querySelector('article.bd-article') || document.body;
    for (const details of article.querySelectorAll('details')) details.open = true;
    const visible = el => el.checkVisibility ? el.checkVisibility() : el.offsetParent !== null;
    const excerpt = el => (el.textContent || '').replace(/\s+/g, ' ').trim().slice(0, 70);

    // Code blocks (cells, outputs, listings) that scroll sideways.
    const wideCode = [...article.querySelectorAll('pre')]
        .filter(pre => visible(pre) && pre.scrollWidth > pre.clientWidth + 1)
        .map(pre => `${pre.scrollWidth - pre.clientWidth} px too wide: ${excerpt(pre)}`);

    // Display equations wider than their block, and equation numbers drawn over the math.
    const wideMath = [], numberOverMath = [];
    for (const block of article.querySelectorAll('div.math')) {
        const math = block.querySelector('mjx-container > mjx-math');
        if (!math || !visible(block)) continue;
        const box = block.getBoundingClientRect(), m = math.getBoundingClientRect();
        const label = block.id || excerpt(block.querySelector('mjx-assistive-mml') || block);
        if (m.width > block.clientWidth + 1 || m.left < box.left - 1 || m.right > box.right + 1)
            wideMath.push(`${Math.round(m.width)} px in ${block.clientWidth} px: ${label}`);
        const number = block.querySelector('.eqno');
        if (number) {
            const n = number.getBoundingClientRect();
            if (n.left < m.right - 1 && n.right > m.left + 1 && n.top < m.bottom - 1 && n.bottom > m.top + 1)
                numberOverMath.push(`${number.textContent.trim()} over ${label}`);
        }
    }

    // Prose as the reader sees it (everything opened), without code and typeset math.
    const skip = el => notProse.includes(el.tagName.toLowerCase()) || el.tagName.toLowerCase().startsWith('mjx-');
    const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT, {acceptNode: node => {
        for (let el = node.parentElement; el && el !== article; el = el.parentElement)
            if (skip(el)) return NodeFilter.FILTER_REJECT;
        return visible(node.parentElement) ? NodeFilter.FILTER_ACCEPT : NodeFilter.FILTER_REJECT;
    }});
    const prose = [];
    while (walker.nextNode()) prose.push(walker.currentNode.textContent);

    // Images: a real description, not a file name.
    const noAlt = [...article.querySelectorAll('img')]
        .filter(img => { const alt = (img.getAttribute('alt') || '').trim();
                         return alt.length < 8 || /^\S*\.(png|jpe?g|gif|svg)$/i.test(alt) || /^\S*\/\S*$/.test(alt); })
        .map(img => `${img.id || (img.getAttribute('src') || '').slice(0, 40)} (alt=${JSON.stringify(img.getAttribute('alt'))})`);

    // Bytes the browser loaded for this page: the HTML and every resource it requested.
    const entries = [...performance.getEntriesByType('navigation'), ...performance.getEntriesByType('resource')];
    const bytes = entries.reduce((sum, e) => sum + (e.decodedBodySize || e.encodedBodySize || 0), 0);
    const scripts = [...document.scripts].map(s => s.src).filter(Boolean).map(src => new URL(src).pathname);

    // The page's chrome: what stands above the chapter title, how many search boxes show.
    const title = article.querySelector('h1');
    const aboveTitle = title ? [...article.querySelectorAll('.cell')]
        .filter(cell => visible(cell) && (cell.compareDocumentPosition(title) & Node.DOCUMENT_POSITION_FOLLOWING))
        .map(excerpt) : [];
    const searchBoxes = [...document.querySelectorAll('.search-button-field, form.bd-search')].filter(visible).length;

    return {wideCode, wideMath, numberOverMath, prose: prose.join(''), noAlt, bytes,
            requests: entries.length, scripts, aboveTitle, searchBoxes};
}"""
