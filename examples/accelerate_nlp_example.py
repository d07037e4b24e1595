"""A Hugging Face Accelerate fine-tuning script in the shape of Accelerate's own examples/nlp_example.py
(sequence-pair classification with a BERT-like model, AdamW, a linear warmup schedule, accumulation, evaluation
with gather_for_metrics), trained with ZeroAdam by changing the three lines marked `# zerofast`; each mark
gives the line Accelerate's version has. Runs on the CPU, offline: the model is built from a small config and
the data are random token pairs whose first token is their label.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_nlp_example.py --cpu   # 2 CPU processes
    torchrun --nproc-per-node 2 examples/accelerate_nlp_example.py --cpu --mixed_precision bf16
"""

import argparse
import json

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup, set_seed

# zerofast (Accelerate's line: from accelerate import Accelerator)
from zerofast.integrations.accelerate import ZeroAccelerator, ZeroAdam

EVAL_BATCH_SIZE = 32


class Pairs(Dataset):
    """Random sentence pairs of `seq` tokens, whose first token is their label."""

    def __init__(self, n: int, seq: int = 32, vocab: int = 128, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        half = seq // 2
        self.ids[:, 0] = self.labels  # the first token says which: a task the model learns in a few steps
        self.types = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(seq - half, dtype=torch.long)])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "token_type_ids": self.types, "labels": self.labels[i]}


def get_dataloaders(accelerator, batch_size: int = 16):
    with accelerator.main_process_first():  # (Accelerate's version tokenizes GLUE MRPC here)
        train, evaluation = Pairs(256, seed=0), Pairs(64, seed=1)
    train_dataloader = DataLoader(train, shuffle=True, batch_size=batch_size, drop_last=True)
    eval_dataloader = DataLoader(evaluation, shuffle=False, batch_size=EVAL_BATCH_SIZE, drop_last=False)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    lr, num_epochs, seed, batch_size, accumulation = (
        config[k] for k in ("lr", "epochs", "seed", "batch", "accumulation")
    )
    accelerator_args = dict(
        cpu=args.cpu, mixed_precision=args.mixed_precision, gradient_accumulation_steps=accumulation
    )
    # zerofast (Accelerate's line: accelerator = Accelerator(**accelerator_args))
    accelerator = ZeroAccelerator(**accelerator_args)
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
        )  # (Accelerate's version: AutoModelForSequenceClassification.from_pretrained("bert-base-cased"))
    )
    # zerofast (Accelerate's line: optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr))
    optimizer = ZeroAdam(model, lr=lr, stage=3, mixed_precision=accelerator.mixed_precision)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=10,
        num_training_steps=(len(train_dataloader) * num_epochs) // accumulation,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    history = []
    for epoch in range(num_epochs):
        model.train()
        total = 0.0
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            total += loss.detach().float().item()
        model.eval()
        correct = seen = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            seen += len(references)
        history.append({"epoch": epoch, "train_loss": total / len(train_dataloader), "accuracy": correct / seen})
        accelerator.print(f"epoch {epoch}:", history[-1])
    if args.out and accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(history, f)
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of a training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=str, default=None, help="Where to write the history as JSON (main process).")
    args = parser.parse_args()
    config = {"lr": 1e-3, "epochs": args.epochs, "seed": 42, "batch": 16, "accumulation": 2}
    training_function(config, args)


if __name__ == "__main__":
    main()
