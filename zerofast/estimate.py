"""`python -m zerofast.estimate`: per-rank memory by the ZeRO paper's formulas, in zerofast/tools/estimate.py."""

import sys

from .tools.estimate import main

if __name__ == "__main__":
    sys.exit(main())
