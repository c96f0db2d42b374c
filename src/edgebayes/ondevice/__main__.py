"""`python -m edgebayes.ondevice ...`: the runner where edgebayes is installed (on the device, runner.pyz)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
