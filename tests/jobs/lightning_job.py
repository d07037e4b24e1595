"""The Lightning integration's jobs, run by tests/test_lightning.py on CPU (gloo):
`python tests/jobs/lightning_job.py train|resume OUT [WORLD]` (Lightning's own launcher starts the other
processes: the Trainer's devices=WORLD), and `python -m torch.distributed.run ... tests/jobs/lightning_job.py
torchrun OUT` (the pytorch_lightning package, under torchrun's environment; with offload= too). Rank 0 writes
OUT/<job>.json and the tensors the test compares (OUT/<job>-*.pt); the test asserts on them.

The model: tests/models.py's Nested (blocks at backbone.layers[i], the embedding tied to the head at
the root). Every rank takes 6 // WORLD sequences per micro-batch from the DistributedSampler Lightning
puts in (for training shuffled, with seed 0 and the epoch: one permutation at every world size, rank r
taking every WORLD-th index), so the global batch of a step is the same six sequences at 2 and at 3
ranks, and a run resumed at another world size is comparable with the uninterrupted one.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
JOB, OUT = sys.argv[1], sys.argv[2]
WORLD = int(sys.argv[3]) if len(sys.argv) > 3 else 2
if JOB == "torchrun":
    import pytorch_lightning as pl  # noqa: E402
    from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
    from pytorch_lightning.strategies import DDPStrategy  # noqa: E402

    from zerofast.integrations.pytorch_lightning import ZeroStrategy  # noqa: E402
else:
    import lightning.pytorch as pl  # noqa: E402
    from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
    from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

    from zerofast.integrations.lightning import ZeroStrategy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared modules
from models import Nested  # noqa: E402

from zerofast import OffloadPolicy, ZeroAdam  # noqa: E402
from zerofast.optim.zero_adam import parts_of  # noqa: E402

EPOCHS = 3
GLOBAL_BATCH = 6
STEPS_PER_EPOCH = 4  # 48 sequences / 6 per micro-batch / accumulate_grad_batches=2
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
LOW = {"32-true": None, "bf16-mixed": "bf16", "16-true": "fp16"}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed, vocab=48, seq=12):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)
        self.y = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def loader(n, seed):
    return torch.utils.data.DataLoader(Tokens(n, seed), batch_size=GLOBAL_BATCH // WORLD, shuffle=False)


class Lit(pl.LightningModule):
    """Nested with AdamW over decay / no-decay groups and a warmup schedule stepped every optimizer
    step; optimizer="sgd" returns what ZeroStrategy must refuse, optimizer="zero" a ZeroAdam."""

    def __init__(self, optimizer="adamw", manual=False, zero_stage=3):
        super().__init__()
        self.net = Nested()
        self.optimizer_kind = optimizer
        self.zero_stage = zero_stage
        self.automatic_optimization = not manual
        self.losses = []

    def training_step(self, batch, index):
        _, loss = self.net(*batch)
        self.losses.append(loss.item())
        self.wrapped = type(self.trainer.strategy.model).__name__  # DDP's wrapper, or the module itself
        if not self.automatic_optimization:
            opt, scheduler = self.optimizers(), self.lr_schedulers()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            scheduler.step()
        return loss

    def validation_step(self, batch, index):
        _, loss = self.net(*batch)
        self.log("val_loss", loss, sync_dist=True)

    def predict_step(self, batch, index):
        return self.net(*batch)[0].argmax(-1)

    def configure_optimizers(self):
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        if self.optimizer_kind == "zero":
            dtype = LOW[self.trainer.precision]  # a ZeroAdam built here states its own precision
            opt = ZeroAdam(self, stage=self.zero_stage, weight_decay=0.1, mixed_precision=dtype, **HYPER)
        else:
            decay = [p for p in self.parameters() if p.ndim >= 2]
            rest = [p for p in self.parameters() if p.ndim < 2]
            opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], **HYPER
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer(strategy, epochs=EPOCHS, ckpt_dir=None, **kw):
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1, save_last=True)] if ckpt_dir else []
    base = dict(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(ckpt_dir),
        callbacks=callbacks,
        num_sanity_val_steps=2,
    )
    base.update(kw)
    return pl.Trainer(**base)


def ddp():
    return DDPStrategy(process_group_backend="gloo")


def params(t, module):
    """The whole parameters (ZeroAdam's full_state_dict: gathered in stage 3) as fp32 copies."""
    zero = getattr(t.strategy, "zero", None)
    state = zero.full_state_dict() if zero is not None else module.state_dict()
    return {k: v.detach().float().clone() for k, v in state.items()}


def fit(name, strategy, res, module=None, ckpt_path=None, val=True, **kw):
    module = module or Lit()
    t = trainer(strategy, **kw)
    t.fit(module, loader(48, 0), loader(12, 1) if val else None, ckpt_path=ckpt_path)
    res[name] = {
        "losses": module.losses,
        "global_step": t.global_step,
        "val_loss": float(t.callback_metrics["val_loss"]) if val else None,
        "wrapped": module.wrapped,
        "optimizer": type(t.optimizers[0]).__name__,
    }
    save(name, params(t, module))
    return t, module


def save(name, value):
    if dist.get_rank() == 0:
        torch.save(value, os.path.join(OUT, f"{JOB}-{name}.pt"))


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test asserts on the type and message)
        return f"{type(e).__name__}: {e}"
    return None


def train():
    res = {}
    fit("ddp", ddp(), res, ckpt_dir=os.path.join(OUT, "ckpt-ddp"))
    for stage in (1, 2, 3):
        # stage 3 saves asynchronously (ModelCheckpoint's and the saves by hand)
        t, module = fit(
            f"stage{stage}",
            ZeroStrategy(stage=stage, save_async=stage == 3),
            res,
            ckpt_dir=os.path.join(OUT, f"ckpt-stage{stage}") if stage > 1 else None,
        )
        if stage == 3:  # evaluation after fit, on the sharded module; and a save by hand
            res["stage3"]["validate"] = t.validate(module, loader(12, 1), verbose=False)[0]["val_loss"]
            res["stage3"]["predict"] = [p.tolist() for p in t.predict(module, loader(6, 2))]
            t.save_checkpoint(os.path.join(OUT, "by-hand.ckpt"))
            t.strategy.save_full_weights = True  # the module's whole state_dict in lightning.ckpt too
            t.save_checkpoint(os.path.join(OUT, "full.ckpt"))
            if dist.get_rank() == 0:
                res["stage3"]["files"] = sorted(os.listdir(os.path.join(OUT, "by-hand.ckpt")))
                res["stage3"]["ckpts"] = sorted(os.listdir(os.path.join(OUT, "ckpt-stage3")))
    # gradient_clip_algorithm="value", DDP against stage 2
    fit("ddp-value", ddp(), res, epochs=1, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    # (hybrid sharding, shard_size=1: each rank clamps the whole gradient after the replicas' all_reduce)
    fit(
        "stage2-value",
        ZeroStrategy(stage=2, shard_size=1),
        res,
        epochs=1,
        gradient_clip_val=0.01,
        gradient_clip_algorithm="value",
    )
    # Manual optimization: manual_backward, clip_gradients, opt.step(), the scheduler by hand
    fit(
        "ddp-manual",
        ddp(),
        res,
        module=Lit(manual=True),
        epochs=1,
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        val=False,
    )
    fit(
        "stage3-manual",
        ZeroStrategy(stage=3),
        res,
        module=Lit(manual=True),
        epochs=1,
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        val=False,
    )
    # A ZeroAdam from configure_optimizers, in bf16 (stage 3) and in fp16 with its loss scaling (stage
    # 2; "16-true": Lightning turns "16-mixed" into bf16 on CPU): equal to the same ZeroAdam in its own loop
    for stage, precision in ((3, "bf16-mixed"), (2, "16-true")):
        name = f"stage{stage}-{LOW[precision]}"
        t, _ = fit(
            name,
            ZeroStrategy(),
            res,
            module=Lit(optimizer="zero", zero_stage=stage),
            epochs=1,
            precision=precision,
            val=False,
        )
        res[name]["loss_scale"] = t.strategy.zero.loss_scale
        res[f"own-{name}"] = own_loop(name, stage, LOW[precision])
    res["errors"] = {
        "sgd": error_of(lambda: trainer(ZeroStrategy(stage=2), epochs=1).fit(Lit(optimizer="sgd"), loader(48, 0))),
        "both": error_of(lambda: trainer(ZeroStrategy(stage=2), epochs=1).fit(Lit(optimizer="zero"), loader(48, 0))),
    }
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "train.json"), "w") as f:
            json.dump(res, f)


def own_loop(name, stage, dtype):
    """A ZeroAdam-from-configure_optimizers run's training by hand: the same ZeroAdam, schedule,
    accumulation and clipping over the same micro-batches, without Lightning; backward through
    opt.backward (fp16's loss scale)."""
    module = Lit()
    opt = ZeroAdam(module, stage=stage, weight_decay=0.1, mixed_precision=dtype, **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    sampler = torch.utils.data.DistributedSampler(Tokens(48, 0), shuffle=True, seed=0)  # Lightning's, epoch 0
    batches = list(torch.utils.data.DataLoader(Tokens(48, 0), batch_size=GLOBAL_BATCH // WORLD, sampler=sampler))
    losses = []
    for i in range(0, len(batches), 2):
        with opt.no_sync():
            _, loss = module.net(*batches[i])
            opt.backward(loss / 2)
        losses.append(loss.item())
        _, loss = module.net(*batches[i + 1])
        opt.backward(loss / 2)
        losses.append(loss.item())
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        scheduler.step()
    save(f"own-{name}", {k: v.float().clone() for k, v in opt.full_state_dict().items()})
    return {"losses": losses, "loss_scale": opt.loss_scale}


def resume():
    """Fresh processes (WORLD of them): each run resumes a checkpoint the train job wrote after
    epoch 0 and trains to the end, to compare with the uninterrupted run."""
    res = {}
    first = "epoch=0-step=4.ckpt"
    if WORLD == 2:
        fit("stage3-from-stage2", ZeroStrategy(stage=3), res, ckpt_path=os.path.join(OUT, "ckpt-stage2", first))
        fit("stage2-from-ddp", ZeroStrategy(stage=2), res, ckpt_path=os.path.join(OUT, "ckpt-ddp", first))
        # evaluation alone from a sharded checkpoint: no optimizer, the whole model on each rank
        t = trainer(ZeroStrategy(stage=3))
        res["validate-only"] = t.validate(
            Lit(), loader(12, 1), ckpt_path=os.path.join(OUT, "by-hand.ckpt"), verbose=False
        )[0]["val_loss"]
    else:
        fit("stage1-from-stage3", ZeroStrategy(stage=1), res, ckpt_path=os.path.join(OUT, "ckpt-stage3", first))
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, f"resume{WORLD}.json"), "w") as f:
            json.dump(res, f)


def torchrun():
    """pytorch_lightning under torchrun: DDP against stage 3; stage 3 again with its optimizer state on
    disk (offload=, passed through to ZeroAdam), to equal the run in memory bitwise."""
    res = {}
    fit("ddp", ddp(), res, epochs=1)
    fit("stage3", ZeroStrategy(stage=3), res, epochs=1)
    folder = os.path.join(OUT, "offload")
    t, _ = fit("stage3-disk", ZeroStrategy(stage=3, offload=f"disk:{folder}"), res, epochs=1)
    offload = t.strategy.zero.report().offload
    res["stage3-disk"]["offload"] = [offload.state, offload.folder.startswith(folder), offload.read_bytes]
    # The one-step-delayed update: fit() applies the last step's update before it returns
    t = trainer(ZeroStrategy(stage=2, offload=OffloadPolicy("host", delayed_update=True)), epochs=1)
    t.fit(Lit(), loader(48, 0))
    res["stage2-delayed"] = {"in flight": parts_of(t.strategy.zero).offload.update_in_flight, "steps": t.global_step}
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "torchrun.json"), "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    {"train": train, "resume": resume, "torchrun": torchrun}[JOB]()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
