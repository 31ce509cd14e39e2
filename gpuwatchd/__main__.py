import sys

from gpuwatchd.cli import main

sys.exit(main())
