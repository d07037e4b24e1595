"""Stage 3: units.py plans which parameters form a unit (pure functions of the module tree);
schedule.py decides when each unit is gathered and released (pure: the runtime and the estimator
both run it); runtime.py hooks the modules and carries its decisions out on the unit buffers."""
