# make test | make test-compat | make lint | make demo | make bench | make gpu-check | make pack  -- each creates its venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The compat environment: Spark 3.5, pyarrow 14 and petastorm, with OpenCV so that tests can write
# petastorm image fields (constraints-compat.txt).
VENV_COMPAT := .venv-compat
PY_COMPAT := $(VENV_COMPAT)/bin/python
STAMP_COMPAT := $(VENV_COMPAT)/.installed
PYTEST_ARGS ?=
BENCH_ARGS ?=
# A wheel index searched besides PyPI, for torch's CPU build on a machine without a GPU:
# make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyPI's torch for Linux is the CUDA build)
TORCH_INDEX ?=
PIP_INDEX := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: test test-compat lint demo bench java clean gpu-check pack docs

# Each venv compiles the checkout once (where PYTHONDONTWRITEBYTECODE is set, every Python process
# of a run would compile it again; a module edited later is recompiled in memory, never read stale).
$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "installing sparkring's environment into $(VENV) (once; several minutes, pip's progress follows)"
	$(PY) -m pip install --no-compile $(PIP_INDEX) -c constraints.txt -e '.[test,mpi,text,tune,s3]' \
	  'moto[server]'
	@# pip compiles what it installs on one core; compileall on every core (a few files it cannot compile,
	@# written for newer Pythons, it skips as pip does)
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	$(PY) -m compileall -q sparkring tests examples benchmarks conftest.py >/dev/null
	touch $(STAMP)

$(STAMP_COMPAT): pyproject.toml constraints-compat.txt Makefile
	$(PYTHON) -m venv $(VENV_COMPAT)
	$(PY_COMPAT) -m pip install -q --upgrade pip
	$(PY_COMPAT) -m pip install -q $(PIP_INDEX) -c constraints-compat.txt -e '.[test,mpi,petastorm]' \
	  opencv-python-headless
	$(PY_COMPAT) -m compileall -q sparkring tests examples benchmarks conftest.py >/dev/null
	touch $(STAMP_COMPAT)

java:
	@command -v java >/dev/null 2>&1 || { echo "error: no 'java' on PATH; Spark needs a Java 17+ runtime (e.g. apt-get install openjdk-17-jre-headless)"; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then echo "error: Java $$v found; Spark needs Java 17 or newer"; exit 1; fi

test: java $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The compat environment runs the version-dependent tests, a cross-section and the fast layer
# (marked @pytest.mark.compat at each test); FULL=1 runs the whole suite there.
FULL ?=
COMPAT_SELECT := $(if $(FULL),,-m "compat or not slow")
test-compat: java $(STAMP_COMPAT)
	$(PY_COMPAT) -m pytest -q $(COMPAT_SELECT) $(PYTEST_ARGS)

# tests/gpu on this machine's GPUs; GPU_PYTHON: an interpreter with a CUDA build of torch and sparkring
GPU_PYTHON ?=
gpu-check: java
	@if [ -z "$(GPU_PYTHON)" ]; then $(MAKE) --no-print-directory $(STAMP); fi
	$(or $(GPU_PYTHON),$(PY)) -m pytest -q -m gpu tests/gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check sparkring benchmarks examples tests conformance conftest.py
	$(VENV)/bin/mypy
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

# docs/params.md regenerated from sparkring/estimator/params.py's table (a test checks it), then the
# guides built as a site into build/site; --strict: a broken link or a page left out of the nav fails
docs: $(STAMP)
	$(PY) -c "import re, sparkring.estimator.params as p; t = open('docs/params.md').read(); \
	open('docs/params.md', 'w').write(re.sub(r'(?s)<!-- params:begin -->.*<!-- params:end -->', \
	lambda m: '<!-- params:begin -->\n' + p.reference_markdown() + '\n<!-- params:end -->', t))"
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

demo: java $(STAMP)
	SPARK_LOCAL_IP=127.0.0.1 $(PY) examples/digits.py

bench: java $(STAMP)
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run_all.py $(BENCH_ARGS)

# The environment executors run on a cluster without sparkring: a virtualenv with sparkring (not
# editable: venv-pack refuses those) and its dependencies at the versions of $(VENV), the
# driver's (PACK_EXTRA: more packages your code needs), packed for spark.archives
# (README "Running on a cluster"). --copies: Spark unpacks archives refusing symlinks that point
# out of them, as a venv's bin/python does; the copy still reads $(PYTHON)'s standard library,
# which must sit at the same path on every node. A .tar.gz or .zip (Spark 4 unpacks a plain .tar
# without the executable bits); PACK_LEVEL=0 stores it uncompressed (faster to build and unpack).
PACK ?= dist/sparkring-env.tar.gz
PACK_VENV ?= build/pack-venv
PACK_LEVEL ?= 4
# Left out of the archive (a third of its size): pyspark's jars (executors run their cluster's own
# Spark; the JVM is never started from the archive) and torch's C++ test binaries.
PACK_EXCLUDE ?= lib/python*/site-packages/pyspark/jars/* lib/python*/site-packages/torch/test/*
pack: $(STAMP)
	rm -rf $(PACK_VENV)
	mkdir -p $(dir $(PACK_VENV))
	$(VENV)/bin/python -m pip freeze --exclude-editable > $(PACK_VENV).versions
	$(PYTHON) -m venv --copies $(PACK_VENV)
	$(PACK_VENV)/bin/python -m pip install -q -c $(PACK_VENV).versions . $(PACK_EXTRA)
	mkdir -p $(dir $(PACK))
	$(VENV)/bin/venv-pack -q --force --compress-level $(PACK_LEVEL) $(foreach p,$(PACK_EXCLUDE),--exclude '$(p)') \
	  -p $(PACK_VENV) -o $(PACK)
	@echo "packed $(PACK): spark-submit --archives $(PACK)#environment --conf spark.pyspark.python=./environment/bin/python ..."

clean:
	rm -rf $(VENV) $(VENV_COMPAT) .pytest_cache build dist *.egg-info
