"""ZeroAdam as a strategy of Lightning (the `lightning` package, `lightning.pytorch`):

    import lightning.pytorch as pl
    from zerofast.integrations.lightning import ZeroStrategy
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3), precision="bf16-mixed")
    trainer.fit(module)     # configure_optimizers returns torch.optim.AdamW / Adam, or ZeroAdam(self, ...)

The same classes for `pytorch_lightning`: zerofast.integrations.pytorch_lightning. Importing this
module checks RELIES_ON against Lightning; what maps to what and the version: zerofast/integrations/_lightning/.
"""

from ._lightning import LIGHTNING_FILE, PRECISIONS, ZERO_DIR
from ._lightning.package import classes_for

__all__ = ["ZeroStrategy", "ZeroPrecision", "ZERO_DIR", "LIGHTNING_FILE", "PRECISIONS", "RELIES_ON"]

RELIES_ON, ZeroPrecision, ZeroStrategy = classes_for("lightning.pytorch", "lightning", __name__)
