# Two commands on a fresh clone (see README):
#   make repro   install, then run the whole pipeline on the default params.yaml through DVC
#   make test    install, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export DVC_NO_ANALYTICS := 1
export PYTHONPATH := $(CURDIR)/src

.PHONY: setup repro snakemake test test-fast lock clean docs-images

$(BIN)/ddpmrepro: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e '.[dev]'
	touch $@

# Bytecode caches into .venv/pycache, not beside the sources (scripts/pycache_prefix.pth.txt says why).
$(VENV)/.pycache-prefix: scripts/pycache_prefix.pth.txt $(BIN)/ddpmrepro
	cp scripts/pycache_prefix.pth.txt "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ddpmrepro-pycache-prefix.pth"
	touch $@

setup: $(BIN)/ddpmrepro $(VENV)/.pycache-prefix

repro: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dvc repro
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dvc metrics show

snakemake: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores all

# The pictures of README.md and docs/img/, from the outputs `make repro` left (Graphviz and Chromium: apt).
docs-images: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/docs_images.py

test: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q

test-fast: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -m "not slow"

lock:
	$(BIN)/pip freeze --exclude-editable | grep -v "^ddpmrepro[=@ ]" | { echo "# Pinned versions for reproducible installs: \`pip install -c requirements.lock -e .[dev]\`."; echo "# Regenerate with \`make lock\` after changing dependencies in pyproject.toml."; cat; } > requirements.lock

clean:
	rm -rf .snakemake logs checkpoints
