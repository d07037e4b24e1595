"""ZeroAdam as a strategy of Lightning (the `lightning` package, `lightning.pytorch`):

    import lightning.pytorch as pl
    from zerofast.integrations.lightning import ZeroStrategy
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3), precision="bf16-mixed")
    trainer.fit(module)     # configure_optimizers returns torch.optim.AdamW / Adam, or ZeroAdam(self, ...)

For the `pytorch_lightning` package the same classes are in zerofast.integrations.pytorch_lightning.
What maps to what, and the version it is written against: zerofast/integrations/_lightning/.
Importing this module checks that Lightning still has what ZeroStrategy relies on (RELIES_ON).
"""

from ._lightning import LIGHTNING_FILE, PRECISIONS, ZERO_DIR
from ._lightning.package import classes_for

__all__ = ["ZeroStrategy", "ZeroPrecision", "ZERO_DIR", "LIGHTNING_FILE", "PRECISIONS", "RELIES_ON"]

RELIES_ON, ZeroPrecision, ZeroStrategy = classes_for("lightning.pytorch", "lightning", __name__)
