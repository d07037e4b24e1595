"""`python -m zerofast.estimate --params N --world W [--stage K] [--precision mixed|fp32] [--bucket-mb B]`"""
import sys

from .memory import main

if __name__ == "__main__":
    sys.exit(main())
