# sandboxd — newcomer entry points. `make run` starts the daemon; `make test` is what CI runs.
CARGO      ?= cargo
IMAGES_DIR ?= $(CURDIR)/images/build
RUN_DIR    ?= $(CURDIR)/.sandboxd
SOCKET     ?= $(RUN_DIR)/sandboxd.sock
VENV       ?= $(CURDIR)/.venv
E2B_ADDR   ?= 127.0.0.1:3000
WEB_ADDR   ?= 127.0.0.1:8090

.PHONY: all deps pydeps mcpdeps pytest-sdk pytest-e2b bench-e2b images image-debian vm-images exec-helper build release run-build run run-ready run-image lint test bench clean

all: build

## deps: install missing Debian packages (as root), or print what to install.
deps:
	@images/deps.sh

## images: build the default image `minimal` (busybox-static) into images/build/, with its
## microVM boot files (vm/: kernel, initramfs with the guest agent, ext4 base disk).
images: deps
	images/build-minimal.sh $(IMAGES_DIR)
	CARGO=$(CARGO) images/build-vm.sh $(IMAGES_DIR) minimal

## image-debian: build the `debian` image (debootstrap bookworm + python3, bash, git), and its vm/.
image-debian: deps
	images/build-debian.sh $(IMAGES_DIR)
	CARGO=$(CARGO) images/build-vm.sh $(IMAGES_DIR) debian

## vm-images: refresh the microVM boot files of the built images (a no-op when the guest agent,
## kernel and rootfs are unchanged; rebuilds the initramfs when the agent changed).
vm-images:
	@for img in minimal debian; do [ ! -f $(IMAGES_DIR)/$$img/image.json ] || CARGO=$(CARGO) images/build-vm.sh $(IMAGES_DIR) $$img || exit 1; done

## exec-helper: the container tier's exec helper (static), into images/build/.tools/ (cheap when
## up to date; make run, test and bench refresh it).
exec-helper:
	CARGO=$(CARGO) images/build-exec-helper.sh $(IMAGES_DIR)

build:
	$(CARGO) build --workspace --bins

release:
	$(CARGO) build --release -p sandboxd -p agent-client --bins

## run-build: the programs `make run` needs (sandboxd, its sandbox-init, sbx), in the `quick`
## profile (Cargo.toml: lightly optimized, no debug info) into target/quick/.
run-build:
	$(CARGO) build --profile quick -p sandboxd -p agent-client --bin sandboxd --bin sandbox-init --bin sbx

## run: build, prepare the default image if missing, start sandboxd in the foreground. The
## build runs beside the apt install and the image build (`-j3`): apt waits on the network and
## the static guest agent's build fills the core the daemon's crate leaves idle.
run:
	@$(MAKE) --no-print-directory -j3 run-ready
	@mkdir -p $(RUN_DIR)
	@echo "sandboxd on unix://$(SOCKET) — in another terminal: export SANDBOXD_SOCKET=unix://$(SOCKET); target/quick/sbx create"
	@echo "E2B SDK: export E2B_API_URL=http://$(E2B_ADDR) E2B_SANDBOX_URL=http://$(E2B_ADDR) E2B_API_KEY=local"
	@echo "The page: http://$(WEB_ADDR)/"
	target/quick/sandboxd --listen unix://$(SOCKET) --state-dir $(RUN_DIR)/state --images-dir $(IMAGES_DIR) --e2b $(E2B_ADDR) --web $(WEB_ADDR) --web-agent-runs $(RUN_DIR)/agent

## run-ready: what `make run` needs, the daemon's build and the default image in parallel.
run-ready: run-build run-image
run-image: deps
	@[ -f $(IMAGES_DIR)/minimal/image.json ] && [ -f $(IMAGES_DIR)/minimal/vm/vm.json ] || $(MAKE) --no-print-directory images
	@$(MAKE) --no-print-directory vm-images exec-helper

## pydeps: Python's grpcio and grpcio-tools from PyPI, for the stock-client test (tests/tests/grpcio.rs).
pydeps:
	@python3 -c 'import grpc, grpc_tools' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check grpcio grpcio-tools

## pytest-sdk: the Python SDK (clients/python) in a virtualenv of its own ($(PYENV_SDK)): installs
## the package as a user would (its messages generated from proto/ by the build), mypy --strict
## on it and its tests, then its pytest suite against the real daemon (target/debug/sandboxd).
PYENV_SDK ?= $(CURDIR)/target/pyenv-sdk
pytest-sdk:
	@[ -x $(PYENV_SDK)/bin/python ] || python3 -m venv $(PYENV_SDK)
	$(PYENV_SDK)/bin/pip install --quiet --disable-pip-version-check ./clients/python'[test]'
	cd $(PYENV_SDK) && bin/mypy --config-file $(CURDIR)/clients/python/pyproject.toml -p sandboxd
	cd clients/python/tests && $(PYENV_SDK)/bin/mypy --config-file ../pyproject.toml .
	$(CARGO) build -p sandboxd
	cd clients/python && SANDBOXD_BIN=$(CURDIR)/target/debug/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) $(PYENV_SDK)/bin/python -m pytest -p no:cacheprovider tests

## mcpdeps: a virtualenv ($(VENV)) with the official MCP Python client (`mcp` from PyPI), for the
## `sbx mcp` test (tests/tests/mcp.rs runs tests/python/mcp_client.py with it).
mcpdeps:
	@[ -x $(VENV)/bin/pip ] || python3 -m venv --clear $(VENV) || { echo "mcpdeps: python3 -m venv failed (on Debian: apt-get install python3-venv)" >&2; exit 1; }
	@$(VENV)/bin/python -c 'import mcp' 2>/dev/null || $(VENV)/bin/python -m pip install --quiet --disable-pip-version-check mcp

## pytest-e2b: the unmodified E2B SDK (pinned in tests/e2b/requirements.txt, from PyPI) in a
## virtualenv of its own ($(PYENV_E2B)), its pytest suite against the daemon's E2B listener on
## every tier (SANDBOXD_E2B_TIERS=process,container,microvm).
PYENV_E2B ?= $(CURDIR)/target/pyenv-e2b
pytest-e2b:
	@[ -x $(PYENV_E2B)/bin/python ] || python3 -m venv $(PYENV_E2B)
	$(PYENV_E2B)/bin/pip install --quiet --disable-pip-version-check -r tests/e2b/requirements.txt
	$(CARGO) build -p sandboxd
	cd tests/e2b && SANDBOXD_BIN=$(CURDIR)/target/debug/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) $(PYENV_E2B)/bin/python -m pytest -p no:cacheprovider .

## bench-e2b: Sandbox.create() + commands.run("true") through the E2B SDK next to the same through
## sandboxd's Python SDK over gRPC, per tier, into BENCHMARKS.md (make bench runs it).
bench-e2b:
	@[ -x $(PYENV_E2B)/bin/python ] || python3 -m venv $(PYENV_E2B)
	$(PYENV_E2B)/bin/pip install --quiet --disable-pip-version-check -r tests/e2b/requirements.txt ./clients/python
	cd tests/e2b && SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) $(PYENV_E2B)/bin/python bench_e2b.py --out $(CURDIR)/BENCHMARKS.md

## lint: clippy with warnings as errors and rustfmt's check, on the whole workspace.
lint:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) fmt --all --check

## test: lint, unit tests and end-to-end tests against the real daemon (needs root; builds both images).
test: deps pydeps mcpdeps lint
	@[ -f $(IMAGES_DIR)/minimal/image.json ] && [ -f $(IMAGES_DIR)/minimal/vm/vm.json ] || $(MAKE) images
	@[ -f $(IMAGES_DIR)/debian/image.json ] && [ -f $(IMAGES_DIR)/debian/vm/vm.json ] || $(MAKE) image-debian
	@$(MAKE) --no-print-directory vm-images exec-helper
	$(CARGO) build --workspace --bins
	SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) $(CARGO) test --workspace --no-fail-fast
	@$(MAKE) --no-print-directory pytest-sdk
	@$(MAKE) --no-print-directory pytest-e2b

## bench: latency and density numbers, with Docker measured in the same run; writes BENCHMARKS.md.
bench: deps release
	@[ -f $(IMAGES_DIR)/minimal/image.json ] && [ -f $(IMAGES_DIR)/minimal/vm/vm.json ] || $(MAKE) images
	@[ -f $(IMAGES_DIR)/debian/image.json ] && [ -f $(IMAGES_DIR)/debian/vm/vm.json ] || $(MAKE) image-debian
	@$(MAKE) --no-print-directory vm-images exec-helper
	$(CARGO) build --release -p sandbox-tests --bin bench
	SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) target/release/bench --out BENCHMARKS.md
	target/release/agent_bench --out BENCHMARKS.md
	$(CARGO) build --release -p sandbox-tests --bin transfer_bench
	SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) target/release/transfer_bench --out BENCHMARKS.md
	$(CARGO) build --release -p sandbox-tests --bin image_bench
	SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) target/release/image_bench --out BENCHMARKS.md
	$(CARGO) build --release -p sandbox-tests --bin restart_bench
	SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) target/release/restart_bench --out BENCHMARKS.md
	$(CARGO) build --release -p sandbox-tests --bin egress_bench
	SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) target/release/egress_bench --out BENCHMARKS.md
	$(CARGO) build --release -p sandbox-tests --bin fleet_bench
	SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) target/release/fleet_bench --out BENCHMARKS.md
	@$(MAKE) --no-print-directory bench-e2b

clean:
	$(CARGO) clean
	rm -rf $(IMAGES_DIR)
