# make test | make test-compat | make lint | make demo | make bench | make gpu-check  -- each creates its venv on first use.
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

.PHONY: test test-compat lint demo bench java clean gpu-check

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,mpi]'
	touch $(STAMP)

$(STAMP_COMPAT): pyproject.toml constraints-compat.txt Makefile
	$(PYTHON) -m venv $(VENV_COMPAT)
	$(PY_COMPAT) -m pip install -q --upgrade pip
	$(PY_COMPAT) -m pip install -q -c constraints-compat.txt -e '.[test,mpi,petastorm]' opencv-python-headless
	touch $(STAMP_COMPAT)

java:
	@command -v java >/dev/null 2>&1 || { echo "error: no 'java' on PATH; Spark needs a Java 17+ runtime (e.g. apt-get install openjdk-17-jre-headless)"; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then echo "error: Java $$v found; Spark needs Java 17 or newer"; exit 1; fi

test: java $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-compat: java $(STAMP_COMPAT)
	$(PY_COMPAT) -m pytest -q $(PYTEST_ARGS)

# tests/gpu on this machine's GPUs; GPU_PYTHON: an interpreter with a CUDA build of torch and sparkring
GPU_PYTHON ?=
gpu-check: java
	@if [ -z "$(GPU_PYTHON)" ]; then $(MAKE) --no-print-directory $(STAMP); fi
	$(or $(GPU_PYTHON),$(PY)) -m pytest -q -m gpu tests/gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check sparkring benchmarks examples tests
	$(VENV)/bin/mypy

demo: java $(STAMP)
	SPARK_LOCAL_IP=127.0.0.1 $(PY) examples/digits.py

bench: java $(STAMP)
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_COMPAT) .pytest_cache build *.egg-info
