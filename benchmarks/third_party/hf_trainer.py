"""A Hugging Face Trainer run as its documentation shows one (a model from a config, a
``Dataset``, ``TrainingArguments``, ``Trainer.train()``), on CPU: a 2-layer GPT-2 from
``GPT2Config`` (no download) and a synthetic token corpus. Only the library's code trains.

    python benchmarks/third_party/hf_trainer.py --bf16 --steps 60
"""

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Random sequences of a tiny language: each token is a fixed function of the one before."""

    def __init__(self, n, length=32, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        nxt = torch.randperm(vocab, generator=g)
        rows = torch.empty(n, length, dtype=torch.long)
        rows[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for i in range(1, length):
            rows[:, i] = nxt[rows[:, i - 1]]
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=24)
    args = p.parse_args()
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
            gradient_accumulation_steps=2, learning_rate=args.lr, warmup_steps=4,
            bf16=args.bf16, use_cpu=True, logging_steps=4, save_strategy="no",
            report_to="none")
        trainer = Trainer(model=model, args=training_args,
                          train_dataset=Tokens(args.steps * 16))
        trainer.train()


if __name__ == "__main__":
    main()
