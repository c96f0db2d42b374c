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
#
# make itself exits 2 whenever a command fails, so the CLI's code (3: a budget fails, 4: the device was not
# reached, ...) is printed with its meaning on the last line; a CI that acts on the code calls
# $(BIN)/edgebayes itself. SET="train.epochs=3 select.mc_samples=[1,2]" passes --set options.
pipeline train select export deploy report: $(STAMP)
	@echo $(BIN)/edgebayes $@ --config $(CONFIG) --device $(DEVICE) $(foreach s,$(SET),--set '$(s)')
	@$(BIN)/edgebayes $@ --config $(CONFIG) --device $(DEVICE) $(foreach s,$(SET),--set '$(s)'); code=$$?; \
	  $(BIN)/python -c 'import sys, edgebayes.cli as c; print(c.exit_code_line(int(sys.argv[1])))' $$code; \
	  exit $$code

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
