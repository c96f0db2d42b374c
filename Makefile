# edgebayes: `make pipeline` sets everything up and runs all stages; `make test` runs the tests.
#   make pipeline DEVICE=local CONFIG=pipeline.yaml
PYTHON ?= python3
VENV   ?= .venv
DEVICE ?= local
CONFIG ?= pipeline.yaml
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup pipeline train select export deploy report test clean distclean sshd-localhost sshd-localhost-stop

setup: $(STAMP)

# The virtualenv is rebuilt whenever the lock file or the project metadata change.
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-deps -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip check
	touch $@

# DEVICE=ssh-localhost is this machine over real SSH: edgebayes starts its throwaway sshd and stops it when
# the command ends (connection.local_sshd). `make sshd-localhost` keeps one running (a command then leaves
# it alone) until `make sshd-localhost-stop`.
pipeline train select export deploy report: $(STAMP)
	$(BIN)/edgebayes $@ --config $(CONFIG) --device $(DEVICE)

sshd-localhost: $(STAMP)
	$(BIN)/python -m edgebayes.deploy.localsshd start

sshd-localhost-stop: $(STAMP)
	$(BIN)/python -m edgebayes.deploy.localsshd stop

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf runs

distclean: clean
	rm -rf $(VENV)
