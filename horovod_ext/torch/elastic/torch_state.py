"""``TorchState``: a model, an optimizer, samplers and plain values, saved in memory by
``commit()``, put back by ``restore()`` and sent from rank 0 to everyone by ``sync()``."""
import copy

import torch

from horovod_ext.torch.functions import broadcast_optimizer_state, broadcast_parameters
from horovod_ext.torch.mpi_ops import broadcast_object
from .sampler import ElasticSampler
from .state import State


class TorchState(State):
    """``TorchState(model=..., optimizer=..., **values)``: ``values`` may be picklable objects
    (epoch, batch counters) and ``ElasticSampler``s; each is reachable as ``state.NAME``."""

    def __init__(self, model: torch.nn.Module = None, optimizer: torch.optim.Optimizer = None,
                 **kwargs):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved = None
        self.save()

    def _samplers(self):
        return {n: getattr(self, n) for n in self._names
                if isinstance(getattr(self, n), ElasticSampler)}

    def _values(self):
        return {n: getattr(self, n) for n in self._names
                if not isinstance(getattr(self, n), ElasticSampler)}

    def save(self):
        self._saved = {
            "model": copy.deepcopy(self.model.state_dict()) if self.model is not None else None,
            "optimizer": (copy.deepcopy(self.optimizer.state_dict())
                          if self.optimizer is not None else None),
            "samplers": {n: s.state_dict() for n, s in self._samplers().items()},
            "values": copy.deepcopy(self._values()),
        }

    def restore(self):
        saved = self._saved
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        for name, sampler in self._samplers().items():
            sampler.load_state_dict(saved["samplers"][name])
        for name, value in copy.deepcopy(saved["values"]).items():
            setattr(self, name, value)

    def sync(self):
        """Rank 0's state everywhere (a worker that just joined has only its initial one), the
        samplers re-split over the new set of workers; then saved, so that a failure before the
        first commit comes back here."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0,
                                 prefix="elastic.model")
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        shared = broadcast_object({"values": self._values(),
                                   "samplers": {n: s.state_dict()
                                                for n, s in self._samplers().items()}},
                                  root_rank=0, name="elastic.state")
        for name, value in shared["values"].items():
            setattr(self, name, value)
        for name, sampler in self._samplers().items():
            sampler.load_state_dict(shared["samplers"][name])
        self.save()
