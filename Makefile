# sandboxd — newcomer entry points. `make run` starts the daemon; `make test` is what CI runs.
CARGO      ?= cargo
IMAGES_DIR ?= $(CURDIR)/images/build
RUN_DIR    ?= $(CURDIR)/.sandboxd
SOCKET     ?= $(RUN_DIR)/sandboxd.sock

.PHONY: all deps images image-debian build release run test bench clean

all: build

## deps: install missing Debian packages (as root), or print what to install.
deps:
	@images/deps.sh

## images: build the default image `minimal` (busybox-static) into images/build/.
images: deps
	images/build-minimal.sh $(IMAGES_DIR)

## image-debian: build the `debian` image (debootstrap bookworm + python3, bash, git).
image-debian: deps
	images/build-debian.sh $(IMAGES_DIR)

build:
	$(CARGO) build --workspace --bins

release:
	$(CARGO) build --release -p sandboxd -p agent-client --bins

## run: build, prepare the default image if missing, start sandboxd in the foreground.
run: deps release
	@[ -f $(IMAGES_DIR)/minimal/image.json ] || $(MAKE) images
	@mkdir -p $(RUN_DIR)
	@echo "sandboxd on unix://$(SOCKET) — in another terminal: export SANDBOXD_SOCKET=unix://$(SOCKET); target/release/sbx create"
	target/release/sandboxd --listen unix://$(SOCKET) --state-dir $(RUN_DIR)/state --images-dir $(IMAGES_DIR)

## test: unit tests and end-to-end tests against the real daemon (needs root; builds both images).
test: deps
	@[ -f $(IMAGES_DIR)/minimal/image.json ] || $(MAKE) images
	@[ -f $(IMAGES_DIR)/debian/image.json ] || $(MAKE) image-debian
	$(CARGO) build --workspace --bins
	SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) $(CARGO) test --workspace

## bench: latency and density numbers, with Docker measured in the same run; writes BENCHMARKS.md.
bench: deps release
	@[ -f $(IMAGES_DIR)/minimal/image.json ] || $(MAKE) images
	@[ -f $(IMAGES_DIR)/debian/image.json ] || $(MAKE) image-debian
	$(CARGO) build --release -p sandbox-tests --bin bench
	SANDBOXD_BIN=$(CURDIR)/target/release/sandboxd SANDBOXD_IMAGES_DIR=$(IMAGES_DIR) target/release/bench --out BENCHMARKS.md
	target/release/agent_bench --out BENCHMARKS.md

clean:
	$(CARGO) clean
	rm -rf $(IMAGES_DIR)
