# resty-loom: build, test and run.
#
#   make run     install what is missing, build, start the example gateway
#   make test    lint, build, run the whole test suite
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
SRC_DIR      := $(BUILD_DIR)/nginx-src
MODULE       := $(BUILD_DIR)/ngx_loom_module.so
SINK         := $(BUILD_DIR)/pubsub-sink
C_SOURCES    := $(wildcard src/*.c src/*.h include/*.h) config
RUNTIMES     := $(patsubst %/Makefile,%,$(wildcard runtimes/*/Makefile))

.PHONY: all deps build runtimes test lint run clean bench

all: build

# Installs the Debian packages listed in deps/apt-packages.txt that are missing.
deps:
	@missing=$$(for p in $$(grep -v '^#' deps/apt-packages.txt); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null \
	        | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	    echo "installing: $$missing"; \
	    if [ ! -f $(BUILD_DIR)/.apt-updated ]; then \
	        apt-get update -qq && mkdir -p $(BUILD_DIR) \
	        && touch $(BUILD_DIR)/.apt-updated; fi; \
	    DEBIAN_FRONTEND=noninteractive flock /tmp/apt.lock \
	        apt-get install -y -qq $$missing >/dev/null; \
	fi

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
	@for d in $(RUNTIMES); do $(MAKE) -C $$d all || exit 1; done

lint:
	luacheck -q lib examples tests/lua bench

test: deps build runtimes lint
	$(PYTHON) -m pytest -q tests $(PYTEST_ARGS)

# Starts the example gateway in the foreground on 127.0.0.1:8080.
run: deps build runtimes
	@examples/gateway/run.sh

# make bench-<area> runs bench/<area>/run.py (writes bench/results/<area>.json)
bench-%: deps build runtimes
	$(PYTHON) bench/$*/run.py

bench: bench-events bench-timer bench-offload bench-watchdog bench-publish

clean:
	rm -rf $(BUILD_DIR)
	@for d in $(RUNTIMES); do $(MAKE) -C $$d clean; done
