"""ZeroAdam as a strategy of Lightning (the `pytorch_lightning` package):

    import pytorch_lightning as pl
    from zerofast.integrations.pytorch_lightning import ZeroStrategy
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3), precision="bf16-mixed")
    trainer.fit(module)     # configure_optimizers returns torch.optim.AdamW / Adam, or ZeroAdam(self, ...)

For the `lightning` package (lightning.pytorch) the same classes are in zerofast.integrations.lightning.
What maps to what, and the version it is written against: zerofast/integrations/_lightning/.
Importing this module checks that pytorch_lightning still has what ZeroStrategy relies on (RELIES_ON).
"""

from ._lightning import LIGHTNING_FILE, PRECISIONS, ZERO_DIR
from ._lightning.package import classes_for

__all__ = ["ZeroStrategy", "ZeroPrecision", "ZERO_DIR", "LIGHTNING_FILE", "PRECISIONS", "RELIES_ON"]

RELIES_ON, ZeroPrecision, ZeroStrategy = classes_for("pytorch_lightning", "pytorch-lightning", __name__)
