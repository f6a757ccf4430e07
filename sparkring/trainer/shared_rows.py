"""The ranks of one host hold the fit's decoded rows once: each split this process would keep in
memory goes into a segment the host's ranks map together, so a row group one rank decoded
serves every rank there (an epoch's new share, or an elastic fit's whole split)."""
from __future__ import annotations

import logging
from typing import Any, List, Optional

import sparkring.collective as sr
from sparkring.collective.host_memory import HostSegment, host_segments
from sparkring.data.split_memory import SharedBuffer

log = logging.getLogger(__name__)

SPLITS = ("train", "val")


def share_rows_on_host(dataset: Any, cache: Optional[bool]) -> List[HostSegment]:
    """Give ``dataset`` shared memory for the splits it would hold (``cache`` as its batches
    take it); the segments it now uses. Collective: every rank calls it at the same point.

    >>> share_rows_on_host(cfg.dataset, cache=None)  # doctest: +SKIP
    [HostSegment(...)]
    """
    if sr.size() < 2:
        return []
    layouts = dataset.memory_layouts(SPLITS, cache)
    segments = host_segments([layout.nbytes if layout is not None else 0 for layout in layouts])
    used = []
    for split, layout, segment in zip(SPLITS, layouts, segments):
        if layout is not None and segment is not None:
            dataset.share_memory(split, SharedBuffer(segment.mm, segment.fd, layout))
            used.append(segment)
            log.info("the %s split's decoded rows are shared by %d ranks of this host (%.0f MiB)", split,
                     segment.local_size, layout.nbytes / 2**20)
    return used
