# One command each: `make demo`, `make test`, `make bench`, `make lint`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.dlop-installed

.PHONY: demo test bench bench-peers lint env clean fuzz gpu-proof

env: $(STAMP)

# torch is pinned to the CPU build; an unpinned torch pulls a multi-GB CUDA build.
# The dev extra holds the compile extra and the extras the tests run for real (dask, s3,
# http, hf; not gcs, which no test server stands in for), for the demo, tests and bench.
$(STAMP): pyproject.toml runtime/gather/_copy.c runtime/order/_shuffle.c compiler/audio/_kernels.c \
		formats/_crc32.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

demo: env
	$(PY) -m dlop.tools.demo

test: env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

bench: env
	$(VENV)/bin/dlop-bench

# LitData, MosaicML Streaming, FFCV, Lhotse and Hugging Face datasets, in their own
# environment (never dlop dependencies). LitData and Streaming require torchvision, which
# does not load beside the CPU torch: they are installed without it, and Streaming gets
# the stand-in in tools/bench/peers-env. datasets 5.2 needs huggingface_hub 1.x, so
# transformers (Streaming imports two classes from it; datasets' feature extractor and
# LengthGroupedSampler) is 5.x although Streaming declares <5. Lhotse's Fbank is pure
# torch (torchaudio does not import here); LilcomChunkyWriter needs lilcom; Lhotse
# imports urllib3 without declaring it.
PEERS := .venv-peers
bench-peers:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q --upgrade pip
	$(PEERS)/bin/pip install -q torch==2.13.0
	$(PEERS)/bin/pip install -q -e '.[compile]'
	$(PEERS)/bin/pip install -q --no-deps litdata==0.2.76 mosaicml-streaming==0.13.0
	$(PEERS)/bin/pip install -q filelock lightning-utilities requests urllib3 tifffile boto3 's3fs>=2024.2' 'moto[server]' \
		obstore 'numpy<2.2' 'xxhash<4' zstd Brotli python-snappy catalogue tqdm pillow \
		transformers==5.23.0 lhotse==1.33.0 lilcom==1.8.2 datasets==5.2.0
	# FFCV compiles against libturbojpeg and OpenCV; without them its row says it did not run.
	-(command -v apt-get >/dev/null && apt-get install -y -q libturbojpeg0-dev libopencv-dev pkg-config >/dev/null)
	-$(PEERS)/bin/pip install -q ffcv==1.0.2
	$(PEERS)/bin/python -c "import torchvision" 2>/dev/null || \
		echo "$(CURDIR)/tools/bench/peers-env" > "$$($(PEERS)/bin/python -c 'import site; print(site.getsitepackages()[0])')/dlop-bench-stubs.pth"
	$(PEERS)/bin/dlop-bench --only peers --out bench-out/peers

# On a CUDA machine: the GPU path measured (pinned copies, side-stream overlap, GPU
# augmentations against the CPU, ResNet18 training naive vs dlop), report in gpu-proof-out/.
gpu-proof: env
	$(PY) -m dlop.tools.gpu_proof --out gpu-proof-out

# The archive fuzzer for longer: hypothesis mutations of index.json, shard headers and
# file kinds, in a child process with a memory cap (DLOP_FUZZ_EXAMPLES to change); and
# the exit-race test with 300 processes instead of 20 (DLOP_EXIT_RUNS).
fuzz: env
	DLOP_FUZZ_RANDOM=1 DLOP_FUZZ_EXAMPLES=$${DLOP_FUZZ_EXAMPLES:-5000} $(VENV)/bin/python -m pytest -q tests/formats/test_fuzz.py
	DLOP_EXIT_RUNS=$${DLOP_EXIT_RUNS:-300} $(VENV)/bin/python -m pytest -q tests/runtime/test_exit.py

# mypy: one strict run over the whole dlop package (settings in pyproject.toml; the modules
# from its package-dir mapping, which .ci/typecheck.py reads), with a user's calls of the
# front ends: tests/typing/spelt.py checks clean, and each mistake in misspelt.py is reported.
MISSPELT := 'Unexpected keyword argument "shufle" for "Loader"' \
	'Unexpected keyword argument "worker_bufers" for "IterableArchive"' \
	'Argument "seed" to "Loader" has incompatible type "str"' \
	'Argument "order" to "IterableArchive" has incompatible type'
lint: env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# one strict run: the package and tests/typing/spelt.py clean, misspelt.py's calls refused
	$(PY) .ci/typecheck.py tests/typing/spelt.py tests/typing/misspelt.py > $(VENV)/typecheck.txt; \
		if grep ': error:' $(VENV)/typecheck.txt | grep -v '^tests/typing/misspelt.py:'; then \
		cat $(VENV)/typecheck.txt; exit 1; fi; \
		for m in $(MISSPELT); do grep -qF "$$m" $(VENV)/typecheck.txt || \
		{ echo "mypy did not report: $$m"; cat $(VENV)/typecheck.txt; exit 1; }; done

clean:
	rm -rf $(VENV) build *.egg-info
