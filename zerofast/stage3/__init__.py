"""Stage 3: units.py plans which parameters form a unit (pure functions of the module tree);
runtime.py gathers and releases them around each module's forward and backward."""
