"""How 1-bit compression walks a flat tensor: cache-sized blocks cut by segments, and the
reused scratch tensors of a caller (``Workspace``), shared by the C kernels and the torch code.

Blocks are multiples of 8 elements, so that each one packs into whole bytes; on GPUs one block
is the whole tensor.  Scales travel as float32, or float64 for float64 tensors.
"""
import threading
from typing import Dict, List, Sequence, Tuple

import torch

from horovod_ext.backends.scratch import Workspace as SharedWorkspace

# Elements per block on CPU: a block's float and integer scratch stays in L2.
BLOCK = 1 << 18
_LOCAL = threading.local()


def packed_bytes(numel: int) -> int:
    return (numel + 7) // 8


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scales travel in: float64 for float64 tensors, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Workspace(SharedWorkspace):
    """Scratch tensors (reused, see horovod_ext.backends.scratch) plus cached block plans."""

    def __init__(self):
        super().__init__()
        self.plans: Dict[tuple, "Plan"] = {}

    def plan(self, numel: int, lengths: Sequence[int], device) -> "Plan":
        block = BLOCK if torch.device(device).type == "cpu" else max(8, numel)
        key = (numel, tuple(lengths), block)
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) > 64:
                self.plans.clear()
            plan = self.plans[key] = Plan(numel, lengths, block)
        return plan


def default_workspace() -> Workspace:
    """This thread's workspace for the public functions."""
    ws = getattr(_LOCAL, "workspace", None)
    if ws is None:
        ws = _LOCAL.workspace = Workspace()
    return ws


class Plan:
    """Blocks of a flat tensor (multiples of 8 elements, so whole bytes) cut by segments:
    ``blocks`` holds (lo, hi, [(piece lo, piece hi, segment, first norm slot)]).  A piece's
    norm is taken over rows of ``ROW`` elements (one slot each, plus one for the rest): torch's
    float32 norm of a long vector is off by ~2e-5, of short rows by ~1e-7."""

    ROW = 256

    def __init__(self, numel: int, lengths: Sequence[int], block: int):
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        if bounds[-1] != numel:
            raise ValueError(f"segment lengths sum to {bounds[-1]}, the tensor has {numel}")
        self.lengths = list(lengths)
        self.blocks: List[Tuple[int, int, List[Tuple[int, int, int, int]]]] = []
        slot_segs: List[int] = []
        seg = 0
        for lo in range(0, numel, block):
            hi = min(lo + block, numel)
            pieces = []
            while seg < len(lengths) and bounds[seg] < hi:
                a, b = max(bounds[seg], lo), min(bounds[seg + 1], hi)
                if a < b:
                    pieces.append((a, b, seg, len(slot_segs)))
                    slot_segs += [seg] * ((b - a) // self.ROW + ((b - a) % self.ROW > 0))
                if bounds[seg + 1] <= hi:
                    seg += 1
                else:
                    break
            self.blocks.append((lo, hi, pieces))
        self.slots = len(slot_segs)
        self.slot_segs = slot_segs
        self._segs: Dict[torch.device, torch.Tensor] = {}
        # for the C kernels: segment lengths, and the float64 counts the scales divide by
        self.lengths_i64 = torch.tensor(self.lengths, dtype=torch.int64)
        self.counts_f64 = self.lengths_i64.double()

    def slot_segments(self, device) -> torch.Tensor:
        t = self._segs.get(device)
        if t is None:
            t = self._segs[device] = torch.tensor(self.slot_segs, device=device)
        return t
