import os
import sys

# Let spawned ranks import the test helpers (tests/ is on sys.path under pytest's default import mode).
sys.path.insert(0, os.path.dirname(__file__))
