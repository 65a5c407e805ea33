"""``hvd.PowerSGD(rank=1, ...)``: PowerSGD as a registry op (adapter over ``powersgd``).

Each request (a gradient, or a group of them) is one fused buffer with its own state: its error
feedback and its Q factors, kept per request name, so the op never fuses separate requests.
DistributedOptimizer hands it DDP's buckets (consecutive layers up to
HOROVOD_GRADIENT_BUCKET_BYTES, one request each), so the factors of all a bucket's matrices go
in one allreduce, as with torch's hook.
``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` with several nodes: an exact average inside the node, then
PowerSGD across nodes, each rank of a node taking its share of the buffer's layers (with the
ranks of the same local rank on the other nodes), then the shares joined inside the node.  Its
state is part of the DistributedOptimizer's ``state_dict()`` (bitwise resume).

Name your requests: an unnamed call gets a fresh name, hence fresh (zero) error and a random Q,
every time.
"""
from typing import Dict, Tuple

import torch

from horovod_ext.algorithms.powersgd import PowerSGDState, powersgd_allreduce_
from horovod_ext.backends.hierarchy import Span
from horovod_ext.backends.partition import balanced_parts

from .base import Op
from .registry import configured_op


class PowerSGDOp(Op):
    floating_point_only = True
    fuse_across_requests = False
    layer_buckets = True

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 use_error_feedback: bool = True, seed: int = 0,
                 batch_tensors_with_same_shape: bool = False):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {rank!r}")
        if start_iter < 0 or min_compression_rate <= 0 or orthogonalization_epsilon < 0:
            raise ValueError(f"PowerSGD: start_iter >= 0, min_compression_rate > 0 and "
                             f"orthogonalization_epsilon >= 0 expected, got {start_iter!r}, "
                             f"{min_compression_rate!r}, {orthogonalization_epsilon!r}")
        self.settings = dict(rank=rank, start_iter=start_iter,
                             min_compression_rate=float(min_compression_rate),
                             warm_start=bool(warm_start),
                             orthogonalization_epsilon=float(orthogonalization_epsilon),
                             use_error_feedback=bool(use_error_feedback), seed=seed,
                             batch_tensors_with_same_shape=bool(batch_tensors_with_same_shape))
        self.name = op_name(**self.settings)
        self._states: Dict[Tuple[str, ...], PowerSGDState] = {}


    def allreduce(self, buffer, layers, comms):
        key = tuple(layer.name for layer in layers) or ("",)
        shapes = [layer.shape for layer in layers] or [tuple(buffer.shape)]
        numels = [layer.numel for layer in layers] or [buffer.numel()]
        # Hierarchical: each rank of a node takes a share of whole layers (PowerSGD factors
        # matrices) across nodes, so no layer crosses the network twice.
        topo = comms.topology
        mine = (balanced_parts(numels, topo.local_size)[topo.local_rank] if comms.hierarchical
                else list(range(len(numels))))
        start = sum(numels[:mine[0]]) if mine else 0
        end = start + sum(numels[i] for i in mine)

        def step(part: torch.Tensor, span: Span) -> torch.Tensor:
            names = tuple(key[i] for i in mine) if span.hierarchical else key
            powersgd_allreduce_(part, [shapes[i] for i in mine], [numels[i] for i in mine],
                                span.comm, self._state(names), key="/".join(names),
                                **self.settings)
            return part

        return comms.reduce(buffer, step, node_average=True, share=(start, end))

    def _state(self, key: Tuple[str, ...]) -> PowerSGDState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = PowerSGDState()
        return state

    # --- inspection and checkpoints --------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self._states.values())

    def state_dict(self) -> dict:
        """This rank's error and Q of every request (one file per rank)."""
        return {"settings": dict(self.settings),
                "states": [(list(k), s.state_dict()) for k, s in self._states.items()]}

    def load_state_dict(self, state: dict) -> None:
        if state["settings"] != self.settings:
            raise ValueError(f"a PowerSGD state saved with {state['settings']} cannot be loaded "
                             f"into {self.name}")
        self._states = {}
        for names, value in state["states"]:
            s = PowerSGDState()
            s.load_state_dict(value)
            self._states[tuple(names)] = s

    def reset(self) -> None:
        self._states = {}


def op_name(rank, start_iter, min_compression_rate, warm_start, orthogonalization_epsilon,
            use_error_feedback, seed, batch_tensors_with_same_shape) -> str:
    return (f"powersgd_r{rank}_s{start_iter}_c{min_compression_rate:g}"
            f"_w{int(warm_start)}_e{orthogonalization_epsilon:g}_f{int(use_error_feedback)}"
            f"_seed{seed}" + ("_batched" if batch_tensors_with_same_shape else ""))


def PowerSGD(rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
             warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
             use_error_feedback: bool = True, seed: int = 0,
             batch_tensors_with_same_shape: bool = False) -> PowerSGDOp:
    """The PowerSGD op with these settings (torch's ``PowerSGDState`` names; ``start_iter`` is its
    ``start_powerSGD_iter``), registered under a name made of them: the same object for the
    same settings, so every rank may call this wherever it needs the op."""
    return configured_op(PowerSGDOp(rank, start_iter, min_compression_rate, warm_start,
                                    orthogonalization_epsilon, use_error_feedback, seed,
                                    batch_tensors_with_same_shape))
