"""``hvd.elastic``: training that goes on when workers leave or join (hvdrun's elastic mode).

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)
    train(state)
"""
from .sampler import ElasticSampler
from .state import HostsUpdatedInterrupt, ObjectState, State, run
from .torch_state import TorchState

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]
