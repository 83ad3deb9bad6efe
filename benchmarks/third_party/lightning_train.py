"""A Lightning run as its documentation shows one (a ``LightningModule`` with
``training_step`` and ``configure_optimizers``, ``L.Trainer(...).fit``), on CPU: a small MLP
classifier on synthetic data. Only the library's code trains.

    python benchmarks/third_party/lightning_train.py --precision bf16-mixed --epochs 3
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LitClassifier(L.LightningModule):
    def __init__(self, lr=1e-3):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data(n=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = (x @ torch.randn(32, 8, generator=g)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=args.epochs, precision=args.precision, accelerator="cpu",
                        devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False)
    trainer.fit(LitClassifier(args.lr), data())


if __name__ == "__main__":
    main()
