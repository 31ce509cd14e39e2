# Install gpuwatchd as a systemd service on a bare-metal node.
#
#   sudo make install                  venv in /opt/gpuwatchd (pinned, with systemd-python),
#                                      unit, sysusers, config
#   make install DESTDIR=/tmp/stage    stage the same tree for a package
#
# Then (not when staging): systemd-sysusers && systemctl daemon-reload &&
# systemctl enable --now gpuwatchd.   See docs/deploy.md.

PYTHON      ?= python3
PREFIX      ?= /opt/gpuwatchd
SYSCONFDIR  ?= /etc
BINDIR      ?= /usr/local/bin
UNITDIR     ?= /usr/local/lib/systemd/system
SYSUSERSDIR ?= /usr/local/lib/sysusers.d
DOCDIR      ?= /usr/local/share/doc/gpuwatchd
# What pip installs into the venv: this source tree, or a wheel built elsewhere, with
# these extras (add pod-resources on a Kubernetes node), at the versions pinned in
# CONSTRAINTS.
SRC         ?= .
EXTRAS      ?= systemd
CONSTRAINTS ?= requirements.txt
PIP_INSTALL_ARGS ?=
DESTDIR     ?=

VENV := $(DESTDIR)$(PREFIX)
CONFDIR := $(SYSCONFDIR)/gpuwatchd

.PHONY: help install install-venv install-files uninstall

help:
	@sed -n '2,9p' Makefile

install: install-venv install-files
	@if [ -z "$(DESTDIR)" ]; then \
	  echo "installed; now run: systemd-sysusers && systemctl daemon-reload" \
	       "&& systemctl enable --now gpuwatchd"; \
	fi

# A venv, not the system site-packages: Debian and Ubuntu forbid pip there (PEP 668),
# and the daemon's pinned dependencies must not follow distribution upgrades.
install-venv:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --disable-pip-version-check --no-warn-script-location \
	  -c "$(CONSTRAINTS)" $(PIP_INSTALL_ARGS) "$(SRC)[$(EXTRAS)]"
# Staged into DESTDIR, scripts would point at the staging path: point them at PREFIX.
	@if [ -n "$(DESTDIR)" ]; then \
	  grep -rlI -F "$(VENV)" $(VENV)/bin $(VENV)/pyvenv.cfg | \
	    xargs -r sed -i "s|$(VENV)|$(PREFIX)|g"; \
	fi

install-files:
	install -d -m 0755 $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(DOCDIR) \
	  $(DESTDIR)$(BINDIR) $(DESTDIR)$(CONFDIR)
	sed -e "s|/opt/gpuwatchd|$(PREFIX)|g" -e "s|/etc/gpuwatchd|$(CONFDIR)|g" \
	  -e "s|/usr/local/share/doc/gpuwatchd|$(DOCDIR)|g" \
	  deploy/systemd/gpuwatchd.service > $(DESTDIR)$(UNITDIR)/gpuwatchd.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/gpuwatchd.service
	install -m 0644 deploy/systemd/gpuwatchd.sysusers $(DESTDIR)$(SYSUSERSDIR)/gpuwatchd.conf
	install -m 0644 config.example.yaml docs/deploy.md $(DESTDIR)$(DOCDIR)/
	install -D -m 0755 deploy/systemd/sandbox_check.py $(DESTDIR)$(PREFIX)/share/sandbox_check.py
# Never overwrite a config the operator has edited.
	@if [ -e $(DESTDIR)$(CONFDIR)/config.yaml ]; then \
	  echo "keeping existing $(CONFDIR)/config.yaml"; \
	else \
	  install -m 0644 config.example.yaml $(DESTDIR)$(CONFDIR)/config.yaml; \
	fi
	ln -sfn $(PREFIX)/bin/gpuwatchd $(DESTDIR)$(BINDIR)/gpuwatchd

# Leaves the config in $(CONFDIR) and the state in /var/lib/gpuwatchd.
uninstall:
	rm -f $(DESTDIR)$(UNITDIR)/gpuwatchd.service $(DESTDIR)$(SYSUSERSDIR)/gpuwatchd.conf \
	  $(DESTDIR)$(BINDIR)/gpuwatchd
	rm -rf $(DESTDIR)$(PREFIX) $(DESTDIR)$(DOCDIR)
