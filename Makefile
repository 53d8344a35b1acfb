# vgpuhost development tasks.  `make dev` once, then `make test`.

# Debian packages needed to build and run vgpuhost in development.
# libvirt-python is compiled by pip against the system libvirt, so it needs
# libvirt-dev + pkg-config + gcc (+ Python headers, which pyenv provides).
# libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients, qemu-system-x86:
# the isolated libvirtd that the end-to-end tests and the demo start
# (vgpuhost/sim/libvirtd.py).
# prometheus: the real Prometheus and promtool the metering tests scrape with and
# check the shipped rules with (tests/test_metering_prometheus.py).
# debhelper ... python3-prometheus-client: `make deb` (dpkg-buildpackage with dh-python,
# lintian); tests/test_deb.py builds the package, checks it with lintian and installs it
# into a throwaway root.
DEB_BUILD_PACKAGES := debhelper dh-python lintian pybuild-plugin-pyproject python3-all python3-setuptools python3-wheel python3-click python3-jinja2 python3-yaml python3-lxml python3-prometheus-client
DEB_PACKAGES := libvirt-dev pkg-config gcc mdevctl driverctl libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients qemu-system-x86 prometheus $(DEB_BUILD_PACKAGES)

PYTHON      ?= python3
VENV        := .venv
VPY         := $(VENV)/bin/python
STAMP       := $(VENV)/.vgpuhost-installed
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers (tests/conftest.py: groups and isolation);
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 4
# The qemu hook's thin client to the agent (C, no dependencies but libc); `hook install`
# finds it next to the package.  Without it the hook uses curl.
CLIENT      := vgpuhost/hook/vgpuhost-hook-client
CLIENT_CFLAGS ?= -O2 -Wall -Wextra -std=c99 -D_FORTIFY_SOURCE=2 -fstack-protector-strong
# Linked statically where libc.a is installed (libc6-dev): no dynamic loader at each start, 0.41 -> 0.28 ms
# of CPU a run (perf stat, 2026-12-07; the hook runs it twice a domain start and stop); else dynamically.
# The Debian package links it dynamically (debian/rules: a static binary would miss libc's security updates).
CLIENT_STATIC ?= $(shell printf 'int main(void){return 0;}\n' | $(CC) -x c -static -o /dev/null - 2>/dev/null && echo -static)
# Wait for a dpkg/apt lock held by another apt-get instead of failing.
APT_OPTS    := -o DPkg::Lock::Timeout=600

.PHONY: dev client deb-deps venv-check test demo bench wheel sdist deb docs docs-cli schemas man completions clean distclean

dev: deb-deps $(STAMP) $(CLIENT)

client: $(CLIENT)

$(CLIENT): vgpuhost/hook/client.c
	$(CC) $(CLIENT_CFLAGS) $(CLIENT_STATIC) -o $@ $<

# Installs only what is missing; does nothing (no apt-get update) when all
# packages are present.
deb-deps:
	@if ! command -v dpkg-query >/dev/null 2>&1; then \
	    echo "dpkg-query not found: not Debian/Ubuntu; install by hand: $(DEB_PACKAGES)" >&2; \
	    exit 0; \
	fi; \
	missing=""; \
	for p in $(DEB_PACKAGES); do \
	    case "$$(dpkg-query -W -f='$${Status}' $$p 2>/dev/null)" in \
	        *" ok installed") ;; \
	        *) missing="$$missing $$p" ;; \
	    esac; \
	done; \
	if [ -z "$$missing" ]; then \
	    echo "Debian packages present: $(DEB_PACKAGES)"; \
	    exit 0; \
	fi; \
	if [ "$$(id -u)" != 0 ]; then \
	    echo "Missing Debian packages:$$missing" >&2; \
	    echo "Install them with:" >&2; \
	    echo "    sudo apt-get install -y --no-install-recommends$$missing" >&2; \
	    exit 1; \
	fi; \
	echo "Installing Debian packages:$$missing"; \
	apt-get $(APT_OPTS) update && \
	DEBIAN_FRONTEND=noninteractive apt-get $(APT_OPTS) install -y --no-install-recommends $$missing

$(VPY):
	$(PYTHON) -m venv $(VENV)

# Reinstalled only when the packaging metadata changes (editable install:
# code changes need no reinstall).
$(STAMP): setup.cfg pyproject.toml | $(VPY)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install -e '.[test]'
	# the read commands start without site (vgpuhost/cli/launcher.py): replaces pip's console script
	$(VPY) -m vgpuhost.cli.launcher > $(VENV)/bin/vgpuhost.tmp && chmod 755 $(VENV)/bin/vgpuhost.tmp \
	    && mv $(VENV)/bin/vgpuhost.tmp $(VENV)/bin/vgpuhost
	touch $@

venv-check:
	@test -x $(VPY) || { echo "no $(VENV): run 'make dev' first" >&2; exit 1; }

test: venv-check
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo: venv-check
	$(VPY) -m vgpuhost.demo

bench: venv-check
	$(VPY) bench/inventory.py
	$(VPY) bench/placement.py
	$(VPY) bench/placement_mdp.py
	$(VPY) bench/layout.py
	$(VPY) bench/scale.py
	$(VPY) bench/hook.py
	$(VPY) bench/utilisation.py
	$(VPY) bench/metering.py

wheel: venv-check
	$(VPY) -m build --wheel --outdir dist .

sdist: venv-check
	$(VPY) -m build --sdist --outdir dist .

# The Debian package (debian/), built from a copy of the tree under build/deb
# (without the locally built hook client) with the system Python and Debian's packages:
# the source package and the .debs (vgpuhost, all architectures, and vgpuhost-hook-client,
# the hook's compiled client), checked by lintian at --pedantic (debian/*.lintian-overrides);
# the .debs land in dist/.
deb:
	rm -rf build/deb && mkdir -p build/deb/vgpuhost dist
	tar --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist --exclude=./site \
	    --exclude=./demo-host --exclude=__pycache__ --exclude='*.egg-info' --exclude=./ansible/.ansible \
	    --exclude=./.hypothesis --exclude=./.pytest_cache \
	    --exclude=./$(CLIENT) -cf - . | tar -C build/deb/vgpuhost -xf -
	cd build/deb/vgpuhost && env PATH=/usr/sbin:/usr/bin:/sbin:/bin dpkg-buildpackage -us -uc
	cp build/deb/vgpuhost_*_all.deb build/deb/vgpuhost-sim_*_all.deb build/deb/vgpuhost-hook-client_*.deb dist/
	env PATH=/usr/sbin:/usr/bin:/sbin:/bin lintian --pedantic --fail-on warning,pedantic build/deb/vgpuhost_*.changes

# The documentation site (docs/ -> site/); warnings are errors (mkdocs.yml: strict).
# The site, with the source archive of this version beside its Source page (docs/source.md: the
# Ansible collection's galaxy.yml names that page as its repository).
docs: venv-check
	$(VENV)/bin/mkdocs build --strict
	rm -rf build/source-sdist
	$(VPY) -m build --sdist --outdir build/source-sdist .
	cp build/source-sdist/vgpuhost-*.tar.gz site/source/

# docs/reference/cli.md is generated from the click commands (tests/test_docs.py checks it).
docs-cli: venv-check
	$(VPY) tools/clidoc.py markdown

# docs/schemas/*.schema.json from every --json document the test suite prints (then review the diff).
schemas: venv-check
	rm -rf build/json-docs
	VGPUHOST_JSON_RECORD=$(CURDIR)/build/json-docs $(VPY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
	$(VPY) tools/jsonschemas.py infer build/json-docs

man: venv-check
	$(VPY) tools/clidoc.py man build/man

completions: venv-check
	$(VPY) tools/clidoc.py completions build/completions

clean:
	rm -rf build dist site *.egg-info .pytest_cache .hypothesis demo-host $(CLIENT)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
