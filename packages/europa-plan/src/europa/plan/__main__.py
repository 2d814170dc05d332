import sys

from europa.plan.cli import main

sys.exit(main())
