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

from horovod_ext.algorithms.powersgd import PowerSGDState, powersgd_allreduce_

from horovod_ext.backends.base import ReduceOp
from .base import Op
from .registry import get_op, register_op
from horovod_ext.backends.partition import balanced_parts


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
        flat = buffer.view(-1)
        if not (comms.hierarchical_allreduce and comms.hierarchy_applies):
            powersgd_allreduce_(flat, shapes, numels, comms.world, self._state(key),
                                key="/".join(key), **self.settings)
            return buffer
        topo = comms.topology
        topo.node_allreduce(flat, ReduceOp.SUM).div_(topo.local_size)
        if topo.local_size == 1:
            powersgd_allreduce_(flat, shapes, numels, topo.cross, self._state(key),
                                key="/".join(key), **self.settings)
            return buffer
        # Every rank of a node holds the node average: each takes its share of the layers
        # across nodes (with the same local rank on the other nodes), and the shares are
        # joined inside the node, so no layer crosses the network twice.
        mine = balanced_parts(numels, topo.local_size)[topo.local_rank]
        start = sum(numels[:mine[0]]) if mine else 0
        end = start + sum(numels[i] for i in mine)
        if mine:
            part = tuple(key[i] for i in mine)
            powersgd_allreduce_(flat[start:end], [shapes[i] for i in mine],
                                [numels[i] for i in mine], topo.cross, self._state(part),
                                key="/".join(part), **self.settings)
        flat[:start].zero_()
        flat[end:].zero_()
        topo.node_allreduce(flat, ReduceOp.SUM)
        return buffer

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
    op = PowerSGDOp(rank, start_iter, min_compression_rate, warm_start,
                    orthogonalization_epsilon, use_error_feedback, seed,
                    batch_tensors_with_same_shape)
    try:
        existing = get_op(op.name)
    except ValueError:
        return register_op(op)
    if not isinstance(existing, PowerSGDOp):
        raise ValueError(f"an op named {op.name!r} is registered already and is not PowerSGD")
    return existing
