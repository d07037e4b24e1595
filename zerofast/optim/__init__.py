"""The optimizer fronts and the parts of a step they order (zero_adam.py's docstring). ZeroAdam and
ZeroMuon are imported on first use, so the estimator never loads the compiled extension through here."""


def __getattr__(name: str):
    if name == "ZeroAdam":
        from .zero_adam import ZeroAdam

        return ZeroAdam
    if name == "ZeroMuon":
        from .muon import ZeroMuon

        return ZeroMuon
    raise AttributeError(f"module 'zerofast.optim' has no attribute {name!r}")
