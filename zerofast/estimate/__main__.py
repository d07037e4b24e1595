"""`python -m zerofast.estimate`: the estimator's command line, in zerofast/tools/estimate.py."""

import sys

from ..tools.estimate import main

if __name__ == "__main__":
    sys.exit(main())
