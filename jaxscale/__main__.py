"""`python -m jaxscale` runs one config, like `python -m jaxscale.run`."""

import sys

from jaxscale.run import main

sys.exit(main())
