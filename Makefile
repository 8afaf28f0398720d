# gptlab: `make book` builds the HTML book, `make test` runs the tests, `make lab` opens Jupyter.
# Each target creates .venv and installs everything on first use.
# `make vendor` re-fetches the JavaScript the pages load offline (MathJax, widget manager) into
# _vendor/ with npm; its output is committed, so building the book never needs it.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv book test lab notebooks vendor clean

venv: $(STAMP)

# Re-runs only when requirements.txt or pyproject.toml change (or .venv is missing).
$(STAMP): requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -r requirements.txt
	$(VENV)/bin/pip install -e . --no-deps
	touch $(STAMP)

book: $(STAMP)
	rm -rf _build
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "Book built: open file://$(CURDIR)/_build/html/index.html"

# Unit tests (tests/test_book_browser.py builds the book and opens every page in headless Chromium;
# it skips where no Chromium is installed), then nbval over the stored notebook outputs (only when notebooks exist).
test: $(STAMP)
	$(VENV)/bin/python -m pytest tests -n 2 --dist loadfile
	@if ls book/*.ipynb >/dev/null 2>&1; then \
		$(VENV)/bin/python -m pytest -n 2 --dist loadfile \
			--nbval --nbval-current-env --nbval-sanitize-with book/sanitize.cfg book/; \
	else \
		echo "No notebooks under book/: nbval skipped."; \
	fi

lab: $(STAMP)
	$(VENV)/bin/python -c "import jupyterlab" 2>/dev/null || $(VENV)/bin/pip install jupyterlab
	$(VENV)/bin/jupyter lab book/

# Re-execute every chapter in place (after a change to the package that alters what they print).
notebooks: $(STAMP)
	$(VENV)/bin/python tools/execute_notebooks.py book/*.ipynb

vendor:
	tools/vendor_js.sh

clean:
	rm -rf _build .pytest_cache .hypothesis .jupyter_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print -exec rm -rf {} +
