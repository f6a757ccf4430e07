"""A LightningModule trained by a user's own Trainer inside sparkring.run() (tests/trainer/test_lightning.py)."""
import os

import torch

N, BATCH, EPOCHS = 64, 8, 2


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, generator=g)
    return x, x @ torch.arange(1.0, 6.0).unsqueeze(1) + 0.1 * torch.randn(N, 1, generator=g)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def reference():
    """One process on the whole batches (BATCH rows from each of 2 ranks)."""
    model, (x, y) = net(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(EPOCHS):
        for i in range(0, N, 2 * BATCH):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[i:i + 2 * BATCH]), y[i:i + 2 * BATCH]).backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train_with_trainer(devices=None, num_nodes=None):
    import pytorch_lightning as pl

    from sparkring.lightning import SparkRingEnvironment, trainer_layout

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x, y = data()
    # unshuffled (Lightning's own sampler shuffles training data): rank r reads rows r, r+2, ...;
    # the two ranks' batches together are the reference's batch
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]),
                                                  rank=int(os.environ["RANK"]), shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    layout = trainer_layout()
    if devices is not None:
        layout = {"devices": devices, "num_nodes": num_nodes}
    module = Regression()
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", plugins=[SparkRingEnvironment()], max_epochs=EPOCHS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, **layout)
    trainer.fit(module, loader)
    return {"rank": trainer.global_rank, "world": trainer.world_size, "steps": trainer.global_step,
            "state": {k.removeprefix("net."): v.detach().clone() for k, v in module.state_dict().items()}}
