"""Rank functions for the tests of a host's ranks holding decoded rows once (run by tests/helpers/spawn.py)."""
import sparkring.collective as sr
import sparkring.data.dataset as dataset_module
from sparkring.trainer.shared_rows import share_rows_on_host


def _counting_row_groups(decoded):
    """dataset_module.arrow_row_groups, recording each row group a reader starts to decode."""
    real = dataset_module.arrow_row_groups

    def counting(*args, **kwargs):
        read = real(*args, **kwargs)

        def go(path, rg):
            decoded.append((path, rg))
            yield from read(path, rg)
        return go
    return counting


def epochs_of_batches(dataset, epochs, share, batch_size=16):
    """This rank's shuffled batches (their ids) over ``epochs`` epochs, and how many row groups
    this process decoded."""
    decoded = []
    dataset_module.arrow_row_groups = _counting_row_groups(decoded)
    shared = share_rows_on_host(dataset, cache=None) if share else []
    ids = [[b["id"].tolist() for b in dataset.batches(batch_size, rank=sr.rank(), size=sr.size(), seed=1, epoch=e)]
           for e in range(epochs)]
    return ids, len(decoded), len(shared)


def elastic_global_batches(dataset, share, global_batch=64):
    """This rank's part of each global batch of two epochs (as an elastic fit reads them: every
    rank holds the whole split), and how many row groups this process decoded."""
    decoded = []
    dataset_module.arrow_row_groups = _counting_row_groups(decoded)
    if share:
        share_rows_on_host(dataset, cache=True)
    ids = [[b["id"].tolist() for b in dataset.global_batches(global_batch, rank=sr.rank(), size=sr.size(), epoch=e)]
           for e in range(2)]
    return ids, len(decoded)
