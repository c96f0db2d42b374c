import sys

from edgebayes.cli import main

sys.exit(main())
