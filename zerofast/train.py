"""`python -m zerofast.train`: the main job, in zerofast/tools/train/."""

import sys

from .tools.train import main

if __name__ == "__main__":
    sys.exit(main())
