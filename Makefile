# The two commands of the README:
#   make demo   pretrain a tiny hybrid MoE (EP=2, 2 processes, gloo) and LoRA-fine-tune it
#   make test   the test suite (CPU, about 27 minutes on 2 cores with the first setup, on TEST_WORKERS
#               pytest-xdist workers, default 2; make test-all adds the slow set)
# Both set up .venv on first use (torch's CPU build where no torch is installed).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-0.1.0
export OMP_NUM_THREADS ?= 1
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist worksteal
TORCHRUN := $(PY) -m torch.distributed.run --nproc-per-node 2 --master-port 29517

.PHONY: demo test test-all test-gpu env clean-demo

$(STAMP): setup.py
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q setuptools wheel
	MAX_JOBS=2 $(PY) -m pip install -q --no-build-isolation -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(TORCHRUN) -m megatron_moe_hybrid.train --config examples/configs/tiny.yaml \
	  --parallel.expert_model_parallel_size 2
	$(TORCHRUN) -m megatron_moe_hybrid.finetune --config examples/configs/tiny_lora.yaml \
	  --parallel.expert_model_parallel_size 2

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not gpu and not slow" --durations=30

test-all: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not gpu"

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

env: $(STAMP)
	$(PY) -m megatron_moe_hybrid.env

clean-demo:
	rm -rf outputs/tiny outputs/tiny_lora
