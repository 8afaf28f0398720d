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

    return {wideMath, numberOverMath, prose: prose.join(''), noAlt, bytes,
            requests: entries.length, scripts, aboveTitle, searchBoxes};
}"""

# Run in a book page once MathJax has typeset it (every <details> opened): how the code and the
# display equations fit at this window width.
# - wide: code blocks with a line wider than the column (they scroll sideways);
# - wrapped: code blocks whose lines reflow, found by their rendered height against the height of
#   the same block with `white-space: pre` (one row per source line), in rows of the block's own
#   line height;
# - clipped: display equations wider than their box with no box between them and it that scrolls;
# - numberOver: equation numbers drawn over the part of the equation that shows;
# - pageWidth: how wide the page is (wider than the window: it scrolls sideways).
LAYOUT_JS = r"""() => {
    const article = document.querySelector('article.bd-article') || document.body;
    for (const details of article.querySelectorAll('details')) details.open = true;
    const visible = el => el.checkVisibility ? el.checkVisibility() : el.offsetParent !== null;
    const excerpt = el => (el.textContent || '').replace(/\s+/g, ' ').trim().slice(0, 60);
    const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
    // Each block's height as shown, then with every line on one row (a style on the block and
    // everything in it, whose :not(#id) outranks any page rule), in rows of its own line height.
    const pres = [...article.querySelectorAll('pre')].filter(visible);
    const heights = pres.map(pre => pre.clientHeight);
    const oneRow = document.createElement('style');
    oneRow.textContent = 'pre:not(#gptlab-none), pre:not(#gptlab-none) * { white-space: pre !important; }';
    document.head.appendChild(oneRow);
    const unwrapped = pres.map(pre => pre.clientHeight);
    oneRow.remove();
    const wrapped = [];
    pres.forEach((pre, i) => {
        const style = getComputedStyle(pre);
        const padding = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
        const rows = pre.textContent.replace(/\n$/, '').split('\n').length;
        const extra = Math.round((heights[i] - unwrapped[i]) / ((unwrapped[i] - padding) / rows));
        if (extra > 0) wrapped.push({extra, text: excerpt(pre)});
    });
    const blocks = pres.length;
    // Blocks with a line wider than the column: they scroll sideways (the longest line's columns).
    const wide = pres.filter(pre => pre.scrollWidth > pre.clientWidth + 1)
        .map(pre => `${Math.max(...pre.textContent.split('\n').map(line => line.length))} columns: ${excerpt(pre)}`);
    const clipped = [], numberOver = [];
    for (const block of article.querySelectorAll('div.math')) {
        const math = block.querySelector('mjx-container > mjx-math');
        if (!math || !visible(block)) continue;
        const label = block.id || excerpt(block).slice(0, 50);
        let shown = math.getBoundingClientRect(), scrolling = false;
        shown = {left: shown.left, right: shown.right, top: shown.top, bottom: shown.bottom};
        for (let el = math.parentElement; el && el !== block.parentElement; el = el.parentElement) {
            if (getComputedStyle(el).overflowX === 'visible') continue;
            const box = el.getBoundingClientRect();
            if (scrolls(el) && el.scrollWidth > el.clientWidth + 1) scrolling = true;
            shown = {left: Math.max(shown.left, box.left), right: Math.min(shown.right, box.right), top: shown.top, bottom: shown.bottom};
        }
        const m = math.getBoundingClientRect(), box = block.getBoundingClientRect();
        if (!scrolling && (m.width > block.clientWidth + 1 || m.left < box.left - 1 || m.right > box.right + 1))
            clipped.push(`${Math.round(m.width)} px in ${block.clientWidth} px: ${label}`);
        const number = block.querySelector('.eqno');
        if (number) {
            const n = number.getBoundingClientRect();
            if (n.left < shown.right - 1 && n.right > shown.left + 1 && n.top < shown.bottom - 1 && n.bottom > shown.top + 1)
                numberOver.push(`${number.textContent.replace('#', '').trim()} over ${label}`);
        }
    }
    return {blocks, wrapped, wide, extraLines: wrapped.reduce((sum, w) => sum + w.extra, 0), clipped, numberOver,
            pageWidth: document.documentElement.scrollWidth, windowWidth: window.innerWidth};
}"""
