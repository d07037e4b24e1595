"""The optimizer front and the parts of a step it orders (see zero_adam.py's docstring).
ZeroAdam is imported on first use, so that zerofast.config's users (the estimator) never load the
compiled extension through this package."""


def __getattr__(name: str):
    if name == "ZeroAdam":
        from .zero_adam import ZeroAdam

        return ZeroAdam
    if name == "ZeroMuon":
        from .muon import ZeroMuon

        return ZeroMuon
    raise AttributeError(f"module 'zerofast.optim' has no attribute {name!r}")
