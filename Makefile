# gptlab: `make book` builds the HTML book, `make test` runs the tests, `make lab` opens Jupyter.
# `make student` and `make instructor` write the course editions into build/student and
# build/instructor (nbgrader; docs/COURSE.md).
# Each target creates .venv and installs everything on first use.
# `make vendor` re-fetches the JavaScript the pages load offline (MathJax, widget manager) into
# _vendor/ with npm; its output is committed, so building the book never needs it.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv book book-student test lab notebooks student instructor vendor clean

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

# The HTML book for credit-bearing use (docs/COURSE.md): as `make book`, without the answer cells,
# code solutions, grading cells and written model answers; built from a copy in build/book-student.
book-student: $(STAMP)
	rm -rf build/book-student && mkdir -p build/book-student
	cp -r _config.yml _toc.yml references.bib _vendor book tools benchmarks build/book-student/
	$(VENV)/bin/python -c "from gptlab.course.editions import without_answers; without_answers('build/book-student/book')"
	$(VENV)/bin/jupyter-book build build/book-student -W -n --keep-going
	@echo "Student book built: open file://$(CURDIR)/build/book-student/_build/html/index.html"

# nbval re-executes every chapter and compares each output with the stored one (docs/CHAPTERS.md).
# --timeout (pytest-timeout) bounds each cell together with its kernel's start: a kernel that never
# answers fails that chapter instead of hanging the run.
NBVAL := $(VENV)/bin/python -m pytest -n 2 --dist loadfile --nbval --nbval-current-env \
	--nbval-sanitize-with book/sanitize.cfg --nbval-cell-timeout=600 --nbval-kernel-startup-timeout=120 \
	--timeout=900
# The chapters that leave torch's thread count alone; the others call torch.set_num_threads(1).
UNPINNED := $(shell grep -L 'set_num_threads' book/[0-9]*.ipynb)

# Another CPU's kernels, as far as this machine can show them: MKL's portable code path, torch's
# scalar kernels instead of its AVX2/AVX-512 ones, and oneDNN's oldest instruction set.
OTHER_CPU := MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41

# The unit tests (with the book built once and opened in Chromium and in JupyterLab; those two
# skip where no Chromium is installed); then every test that compares float results computed two
# ways (marked roundoff: the gradient-check table, parallel against one process, fused against
# readable, kernels against their twins, low precision against float32) again under OTHER_CPU at
# 2 threads, where each difference must stay below a quarter of its derived bound
# (tests/bounds.py); then every chapter three times against the same stored outputs: default
# kernels; OTHER_CPU; 2 threads per chapter. What a chapter prints must survive all three.
# Each round-off comparison records its difference and bound in _build/bounds/; the table of the
# two runs (tools/bound_table.py) is _build/bounds/table.md, as in docs/TOLERANCES.md.
BOUNDS := $(CURDIR)/_build/bounds

test: $(STAMP)
	rm -rf $(BOUNDS) && mkdir -p $(BOUNDS)
	GPTLAB_BOUND_RECORD=$(BOUNDS)/default.jsonl \
		$(VENV)/bin/python -m pytest tests -n 2 --dist loadfile --timeout=1800
	@echo "== the round-off comparisons again: another CPU's kernels, 2 threads, a quarter of each bound"
	$(OTHER_CPU) GPTLAB_TEST_THREADS=2 GPTLAB_BOUND_MARGIN=4 GPTLAB_BOUND_RECORD=$(BOUNDS)/other.jsonl \
		$(VENV)/bin/python -m pytest tests -m roundoff -n 2 --dist loadfile --timeout=1800
	$(VENV)/bin/python tools/bound_table.py "default=$(BOUNDS)/default.jsonl" \
		"other CPU, 2 threads=$(BOUNDS)/other.jsonl" > $(BOUNDS)/table.md
	@echo "== the bounds and their margins: $(BOUNDS)/table.md"
	@echo "== nbval 1/3: default kernels, 1 thread per chapter"
	OMP_NUM_THREADS=1 $(NBVAL) book/
	@echo "== nbval 2/3: another CPU's kernels ($(OTHER_CPU)), 1 thread per chapter"
	OMP_NUM_THREADS=1 $(OTHER_CPU) $(NBVAL) book/
	@echo "== nbval 3/3: 2 threads per chapter, the chapters that do not pin torch's threads"
	OMP_NUM_THREADS=2 $(NBVAL) $(UNPINNED)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab book/

# Re-execute every chapter in place (after a change to the package that alters what they print).
notebooks: $(STAMP)
	$(VENV)/bin/python tools/execute_notebooks.py book/*.ipynb

# The course editions (docs/COURSE.md): the student edition has nbgrader's student version of
# every chapter with graded work; the instructor edition the chapters as they are and RUBRIC.md.
student: $(STAMP)
	rm -rf build/student
	$(VENV)/bin/python -m gptlab edition student build/student

instructor: $(STAMP)
	rm -rf build/instructor
	$(VENV)/bin/python -m gptlab edition instructor build/instructor

# One reveal.js slide deck per chapter (title, sections with their key equations, captioned
# figures, summary) into _build/slides/; they open offline.
slides: $(STAMP)
	$(VENV)/bin/python tools/slides.py

vendor:
	tools/vendor_js.sh

clean:
	rm -rf _build build .pytest_cache .hypothesis .jupyter_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print -exec rm -rf {} +
