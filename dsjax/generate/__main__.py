import sys

from dsjax.generate.cli import main

sys.exit(main())
