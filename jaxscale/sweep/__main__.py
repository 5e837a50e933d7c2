"""`python -m jaxscale.sweep --config experiments/seed_table.py:cpu`: see jaxscale.sweep.runner."""

import sys

from jaxscale.sweep.runner import main

sys.exit(main())
