"""Horovod's classic pytorch_mnist.py, with the checkpoint-and-resume of Horovod's ImageNet
example, unchanged except for its import line, running on Spark through sparkring. MNIST cannot
be downloaded here, so the data is synthetic and MNIST-shaped (28x28 images of 10 classes).

    python -m sparkring run -np 2 examples/horovod_mnist.py --epochs 2 --checkpoint-dir /tmp/ckpt
    python -m sparkring run -np 2 examples/horovod_mnist.py --epochs 3 --checkpoint-dir /tmp/ckpt  # resumes
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import sparkring.collective as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=256)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--train-size", type=int, default=2048)
parser.add_argument("--checkpoint-dir", default=None, help="save checkpoint-<epoch>.pt here after every epoch; "
                    "a later run resumes from the last one")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")


def synthetic_mnist(n, seed):
    """Ten fixed 28x28 templates plus noise: learnable, like digits."""
    g = torch.Generator().manual_seed(1234)
    templates = torch.rand(10, 1, 28, 28, generator=g)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels] + 0.5 * torch.randn(n, 1, 28, 28, generator=g)
    return torch.utils.data.TensorDataset((images - 0.5) / 0.5, labels)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x)


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                epoch, batch_idx * len(data), len(train_sampler),
                100. * batch_idx / len(train_loader), loss.item()))


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    for data, target in test_loader:
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        output = model(data)
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print("\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n".format(test_loss, 100. * test_accuracy))


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(args.train_size, seed=1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = synthetic_mnist(512, seed=2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    # Horovod's ImageNet example: rank 0 finds the last checkpoint and tells the others.
    checkpoint_format = os.path.join(args.checkpoint_dir or ".", "checkpoint-{epoch}.pt")
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if args.checkpoint_dir and os.path.exists(checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                      name="resume_from_epoch").item()

    model = Net()
    if args.cuda:
        model.cuda()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)

    # Restore on the first worker, which broadcasts weights and optimizer state to the others.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        checkpoint = torch.load(checkpoint_format.format(epoch=resume_from_epoch))
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if resume_from_epoch > 0:
        momentum = sum(float(s["momentum_buffer"].abs().sum()) for s in optimizer.state.values())
        everyone = hvd.allgather_object(round(momentum, 6))
        if hvd.rank() == 0:
            print("Resumed from epoch {}: momentum buffers {} on {} ranks (sum {:.6f})".format(
                resume_from_epoch, "equal" if len(set(everyone)) == 1 else "DIFFER", hvd.size(), momentum))

    for epoch in range(resume_from_epoch + 1, args.epochs + 1):
        train(epoch)
        test()
        if hvd.rank() == 0 and args.checkpoint_dir:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       checkpoint_format.format(epoch=epoch))
