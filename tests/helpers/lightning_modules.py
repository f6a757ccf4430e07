"""LightningModules for the estimator tests (importable by Spark's workers)."""
import pytorch_lightning as pl
import torch
import torch.nn.functional as F


def regression_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class Regression(pl.LightningModule):
    """The plain regression_net trained with mse and SGD, written as Lightning users write it."""

    def __init__(self):
        super().__init__()
        self.net = regression_net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.log("train_mae", (out - y.view(-1, 1)).abs().mean())
        return F.mse_loss(out, y.view(-1, 1))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", F.mse_loss(self(x), y.view(-1, 1)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Classifier(pl.LightningModule):
    """A classifier with an LR scheduler (per epoch or per step), its learning rate logged at
    every epoch's end, and a predict_step that gives the class."""

    def __init__(self, interval="epoch", d=8, classes=3):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
        self.interval = interval

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("train_acc", (logits.argmax(1) == y).float().mean())
        return {"loss": F.cross_entropy(logits, y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log_dict({"val_acc": (logits.argmax(1) == y).float().mean()})
        return F.cross_entropy(logits, y)

    def predict_step(self, batch, batch_idx):
        return self(batch).argmax(1)

    def on_train_epoch_end(self):
        self.log("lr", self.opt.param_groups[0]["lr"])

    def configure_optimizers(self):
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.interval == "epoch":
            scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
        elif self.interval == "lambda":  # computed from its own epoch count, which only its state keeps
            scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda epoch: 0.5 ** epoch)
        else:
            scheduler = torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=0.9)
        interval = "step" if self.interval == "step" else "epoch"
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": scheduler, "interval": interval}}


class NoOptimizer(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).sum()


class Manual(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class DictXOR(pl.LightningModule):
    """A LightningModule written for Horovod: its steps read batch['features'] and batch['y']."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(2, 8), torch.nn.Linear(8, 1)

    def forward(self, features):
        return torch.sigmoid(self.lin2(torch.tanh(self.lin1(features.float()))))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def training_step(self, batch, batch_idx):
        loss = F.binary_cross_entropy(self(batch["features"]), batch["y"].unsqueeze(1).float())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.binary_cross_entropy(self(batch["features"]), batch["y"].unsqueeze(1).float()))


class LegacyEpochEndXOR(DictXOR):
    """DictXOR as Horovod's tests write it for Lightning 1.x: validation_epoch_end(outputs) logs their
    mean, and configure_optimizers returns a named, stepped scheduler."""

    def validation_step(self, batch, batch_idx):
        loss = F.binary_cross_entropy(self(batch["features"]), batch["y"].unsqueeze(1).float())
        self.log("val_loss", loss)
        return loss

    def validation_epoch_end(self, outputs):
        self.log("avg_val_loss", torch.stack(outputs).mean())
        self.log("val_batches", float(len(outputs)))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return [optimizer], [{"scheduler": scheduler, "name": "adam_lr"}]


class EpochCounter(pl.Callback):
    """A Lightning callback written for Horovod (Lightning 1.x): counts the training epochs it sees
    and, through 1.x's on_epoch_end, the training and validation epochs; checks them at the end on
    every rank (as Horovod's test_dummy_callback and its Lightning MNIST example do)."""

    def __init__(self, epochs):
        self.epochs, self.seen, self.ends = epochs, 0, 0

    def on_init_start(self, trainer):
        assert self.seen == 0

    def on_train_epoch_end(self, trainer, module, unused=None):
        self.seen += 1

    def on_epoch_end(self, trainer, module):
        self.ends += 1

    def on_train_end(self, trainer, module):
        assert (self.seen, self.ends) == (self.epochs, 2 * self.epochs), (self.seen, self.ends, self.epochs)


class NonFiniteXOR(DictXOR):
    """DictXOR whose second epoch's loss on rank 1 is not finite (terminate_on_nan's case)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.current_epoch == 1 and self.global_rank == 1 else loss
