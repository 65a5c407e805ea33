"""``ElasticSampler``: the samples of an epoch that no worker has processed yet, split over the
workers present now; after the job re-forms, what is left of the epoch is split again.

Every rank records the same batches (``record_batch`` marks the batch at that position on every
rank, since all ranks step together), so the record is the same everywhere and a commit holds
the whole job's progress, the part of a worker that died since included.  As with
``torch.utils.data.DistributedSampler``, every rank gets the same number of samples: when what
is left does not divide by the number of workers, the first few are repeated to fill the last
positions (at most ``size - 1`` repeats per split); ``record_batch`` counts them once.
"""
import math
from typing import Dict, Iterator, List, Optional

import torch

from horovod_ext.engine import runtime
class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed = torch.zeros(len(dataset), dtype=torch.bool)
        self.reset()

    def set_epoch(self, epoch: int):
        """Start epoch ``epoch``: nothing processed yet, a new order when shuffling."""
        self.epoch = epoch
        self.processed.zero_()
        self.reset()

    def reset(self, num_replicas: Optional[int] = None, rank: Optional[int] = None):
        """Split what is left of the epoch over the current workers (called after re-forming
        and by ``load_state_dict``); ``num_replicas`` and ``rank`` default to the job's."""
        up = runtime.is_initialized()
        self.num_replicas = num_replicas or (runtime.topology().size if up else 1)
        self.rank = rank if rank is not None else (runtime.topology().rank if up else 0)
        if self.shuffle:
            order = torch.randperm(len(self.dataset),
                                   generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(len(self.dataset))
        self.remaining: List[int] = order[~self.processed[order]].tolist()
        self.num_samples = math.ceil(len(self.remaining) / self.num_replicas)
        total = self.num_samples * self.num_replicas
        padded = self.remaining + self.remaining[:total - len(self.remaining)]
        # Rank r takes positions r, r + n, r + 2n, ...: position p of every rank's list lies
        # in one contiguous block of ``padded``, which record_batch marks for all ranks.
        self.indices = padded[self.rank:total:self.num_replicas]

    def record_batch(self, batch_idx: int, batch_size: int):
        """Mark batch ``batch_idx`` (of ``batch_size`` samples per rank) as processed on every
        rank."""
        start = batch_idx * batch_size * self.num_replicas
        stop = min((batch_idx + 1) * batch_size * self.num_replicas, len(self.remaining))
        if start < stop:
            self.processed[torch.tensor(self.remaining[start:stop], dtype=torch.long)] = True

    def record_indices(self, indices):
        self.processed[torch.as_tensor(indices, dtype=torch.long)] = True

    def get_processed_count(self) -> int:
        return int(self.processed.sum())

    def state_dict(self) -> Dict:
        return {"epoch": self.epoch, "processed": self.processed.clone()}

    def load_state_dict(self, state: Dict):
        self.epoch = state["epoch"]
        self.processed = state["processed"].clone()
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
