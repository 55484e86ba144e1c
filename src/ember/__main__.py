"""`python -m ember` runs the CLI."""

import sys

from ember.cli import main

sys.exit(main())
