"""`python -m jaxscale.report experiments/results/<sweep>`: see jaxscale.report.markdown."""

import sys

from jaxscale.report.markdown import main

sys.exit(main())
