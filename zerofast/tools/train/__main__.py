"""`python -m zerofast.tools.train`: the same as `python -m zerofast.train`."""

import sys

from . import main

sys.exit(main())
