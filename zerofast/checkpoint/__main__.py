"""`python -m zerofast.checkpoint info|export ...`"""
import sys

from . import main

sys.exit(main())
