# resty-loom: build, test and run.
#
#   make run     install what the gateway needs, build the module and the C
#                runtime, start the example gateway (no Go, no Rust)
#   make test    install everything, lint, build (runtimes included), run
#                the whole test suite
#   make runtimes  build the offload runtimes (C, Rust, Go, Python, Java, Lua)
#   make install   PREFIX=/usr/local (DESTDIR= for staging)
#   make deb       build/libnginx-mod-http-loom_<version>-1_<arch>.deb
#   make build   build build/ngx_loom_module.so (NGINX_SRC=<tree> to use
#                another nginx or OpenResty source tree) and the benchmark's
#                Pub/Sub sink, build/pubsub-sink

SHELL        := /bin/bash
ROOT         := $(abspath .)
BUILD_DIR    ?= $(ROOT)/build
NGINX_SRC    ?= /usr/share/nginx/src
NGINX        ?= /usr/sbin/nginx
# Debian's python3 (its python3-pytest etc.); another python3 may come first
# on PATH.
PYTHON       ?= /usr/bin/python3
PYTEST_ARGS  ?=
# the suite runs on this many processes (pytest-xdist); tests of one file
# (or one class) stay together, so a module's fixtures are made once. Most
# of a test's time is waiting (for nginx, Redis, a timer's period): four
# processes keep both cores busy (7 min 23 s with two, 4 min 9 s with four)
TEST_JOBS    ?= 4
# Go and Rust: Debian's golang-go (1.19) and cargo (rustc 1.63) from
# make deps are enough; a newer toolchain from go.dev's tarball or rustup
# is used when PATH names it first, and these are its usual places for a
# shell whose PATH lacks them (sudo, CI)
TOOLCHAIN_PATH ?= /usr/local/go/bin:$(HOME)/.cargo/bin
export PATH  := $(PATH):$(TOOLCHAIN_PATH)
SRC_DIR      := $(BUILD_DIR)/nginx-src
MODULE       := $(BUILD_DIR)/ngx_loom_module.so
SINK         := $(BUILD_DIR)/pubsub-sink
C_SOURCES    := $(wildcard src/*.c src/*.h include/*.h) config
RUNTIMES     := $(patsubst %/Makefile,%,$(wildcard runtimes/*/Makefile))

# the release: src/ngx_loom.h's NGX_LOOM_VERSION (each Lua module's
# _VERSION, the rockspec and dist.ini say the same; tests check it)
VERSION      := $(shell sed -n 's/^\#define NGX_LOOM_VERSION *"\(.*\)"/\1/p' \
                  src/ngx_loom.h)
# make install [PREFIX=/usr/local] [DESTDIR=<staging root>]
PREFIX       ?= /usr/local
LUA_DIR      ?= $(PREFIX)/share/lua/5.1
MODULES_DIR  ?= $(PREFIX)/lib/nginx/modules
INCLUDE_DIR  ?= $(PREFIX)/include
DOC_DIR      ?= $(PREFIX)/share/doc/lua-resty-loom

.PHONY: all deps deps-run build runtimes test lint run clean bench install \
        deb

all: build

# apt_install(list): installs the Debian packages of a list that are missing.
# Only apt needs root: without it, one line says what to run.
define apt_install
	@missing=$$(for p in $$(grep -v '^#' $(1)); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null \
	        | grep -q 'install ok installed' || echo $$p; done); \
	missing=$$(echo $$missing); \
	if [ -n "$$missing" ] && [ "$$(id -u)" != 0 ]; then \
	    echo "missing Debian packages; run: sudo apt-get install $$missing"; \
	    exit 1; \
	elif [ -n "$$missing" ]; then \
	    echo "installing: $$missing"; \
	    if [ ! -f $(BUILD_DIR)/.apt-updated ]; then \
	        apt-get update -qq && mkdir -p $(BUILD_DIR) \
	        && touch $(BUILD_DIR)/.apt-updated; fi; \
	    DEBIAN_FRONTEND=noninteractive flock /tmp/apt.lock \
	        apt-get install -y -qq $$missing >/dev/null; \
	fi
endef

# everything: tests, benchmarks, packaging, every runtime
deps:
	$(call apt_install,deps/apt-packages.txt)

# what the example gateway needs
RUN_PACKAGES ?= deps/apt-packages-run.txt
deps-run:
	$(call apt_install,$(RUN_PACKAGES))

build: $(MODULE) $(SINK)

# The configured tree depends on the set of C files (config globs them).
$(SRC_DIR)/.configured: config $(wildcard src/*.c)
	@mkdir -p $(BUILD_DIR)
	@flock $(BUILD_DIR)/.lock bash -c '\
	    rm -rf $(SRC_DIR) && cp -a $(NGINX_SRC) $(SRC_DIR) && \
	    cd $(SRC_DIR) && \
	    if [ -f conf_flags ]; then . ./conf_flags; \
	    else NGX_CONF_FLAGS=(--with-compat --with-threads); fi && \
	    ./configure "$${NGX_CONF_FLAGS[@]}" \
	        --add-dynamic-module=$(ROOT) > $(BUILD_DIR)/configure.log 2>&1 \
	    || { cat $(BUILD_DIR)/configure.log; exit 1; }; \
	    touch .configured'

$(MODULE): $(SRC_DIR)/.configured $(C_SOURCES)
	@flock $(BUILD_DIR)/.lock bash -c '\
	    cd $(SRC_DIR) && make -f objs/Makefile modules \
	        > $(BUILD_DIR)/build.log 2>&1 \
	    || { cat $(BUILD_DIR)/build.log; exit 1; }; \
	    cp objs/ngx_loom_module.so $(MODULE).tmp && \
	    mv $(MODULE).tmp $(MODULE)'
	@echo "built $(MODULE)"

# the benchmark's Pub/Sub sink (tests/pubsub/sink.py starts it)
$(SINK): tests/pubsub/sink.c
	@mkdir -p $(BUILD_DIR)
	$(CC) -O2 -Wall -Wextra -o $@ $<

runtimes:
	@for t in go cargo; do command -v $$t >/dev/null || { echo "make" \
	    "runtimes needs $$t on PATH: make deps installs Debian's" \
	    "golang-go and cargo"; exit 1; }; done
	@for d in $(RUNTIMES); do $(MAKE) -C $$d all || exit 1; done

# the example C runtime alone: the gateway's /offload endpoints use it
RUNTIME_C := runtimes/c/libloom_offload_c.so
$(RUNTIME_C): runtimes/c/loom_c.c include/loom_offload.h
	$(MAKE) -C runtimes/c all

lint:
	luacheck -q lib examples tests/lua bench

test: deps build runtimes lint
	$(PYTHON) -m pytest -q -n $(TEST_JOBS) --dist loadscope tests \
	    $(PYTEST_ARGS)

# Starts the example gateway in the foreground on 127.0.0.1:8080
# (LOOM_GATEWAY_LISTEN=127.0.0.1:8081 make run for another address). It
# needs only the module and the C runtime: no Go, no Rust.
run: deps-run $(MODULE) $(RUNTIME_C)
	@examples/gateway/run.sh

# make bench-<area> runs bench/<area>/run.py (writes bench/results/<area>.json)
bench-%: deps build runtimes
	$(PYTHON) bench/$*/run.py

bench: bench-events bench-timer bench-offload bench-watchdog bench-publish

# the loop tax of timers and of events, each switched on and off under one
# wrk run (bench/onoff.py): bench/results/timer-tax.json, events-tax.json
bench-tax: deps build
	$(PYTHON) bench/timer/tax.py
	$(PYTHON) bench/events/tax.py

# the Lua modules, the nginx module, the offload ABI header and the docs
install: $(MODULE)
	cd lib && find resty -name '*.lua' -exec \
	    install -D -m 0644 {} $(DESTDIR)$(LUA_DIR)/{} \;
	install -D -m 0644 $(MODULE) $(DESTDIR)$(MODULES_DIR)/ngx_loom_module.so
	install -D -m 0644 include/loom_offload.h \
	    $(DESTDIR)$(INCLUDE_DIR)/loom_offload.h
	install -d $(DESTDIR)$(DOC_DIR)
	install -m 0644 README.md CHANGELOG.md LICENSE docs/*.md $(DESTDIR)$(DOC_DIR)

# build/libnginx-mod-http-loom_<version>-1_<arch>.deb (packaging/deb)
deb: $(MODULE)
	packaging/deb/build.sh $(VERSION) $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR)
	@for d in $(RUNTIMES); do $(MAKE) -C $$d clean; done
