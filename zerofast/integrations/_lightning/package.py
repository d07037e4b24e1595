"""classes_for: the two classes a Lightning package (`lightning.pytorch` or `pytorch_lightning`) gets, its
Precision and DDPStrategy with the mixins in front, once the package is checked (zerofast.integrations.hosts)."""

from __future__ import annotations

import importlib
from typing import NamedTuple

from .. import hosts
from .precision import ZeroPrecisionMixin
from .reliance import relies_on
from .strategy import ZeroStrategyMixin


class LightningClasses(NamedTuple):
    relies_on: object  # what the classes rely on in the package (checked)
    precision: type  # ZeroPrecision: the package's Precision under ZeroPrecisionMixin
    strategy: type  # ZeroStrategy: its DDPStrategy under ZeroStrategyMixin


def classes_for(package: str, distribution: str, module: str) -> LightningClasses:
    """ZeroPrecision and ZeroStrategy over `package`'s own classes (Lightning checks a strategy with
    isinstance against those), named as if defined in `module` (the public module users import)."""
    reliance = relies_on(package, distribution=distribution)
    hosts.check(reliance)
    precision_base = importlib.import_module(f"{package}.plugins.precision").Precision
    strategy_base = importlib.import_module(f"{package}.strategies").DDPStrategy
    precision = type(
        "ZeroPrecision",
        (ZeroPrecisionMixin, precision_base),
        {"__doc__": ZeroPrecisionMixin.__doc__, "__module__": module, "__qualname__": "ZeroPrecision"},
    )
    strategy = type(
        "ZeroStrategy",
        (ZeroStrategyMixin, strategy_base),
        {
            "__doc__": ZeroStrategyMixin.__doc__,
            "__module__": module,
            "__qualname__": "ZeroStrategy",
            "_precision_class": precision,
            "_relies_on": reliance,
        },
    )
    return LightningClasses(reliance, precision, strategy)
