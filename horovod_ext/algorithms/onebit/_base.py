"""What 1-bit Adam and 1-bit LAMB share: momentum fusion, their own communication, checkpoints.

The momenta of all parameters with the same device and dtype live in one flat buffer that each
parameter's ``exp_avg`` is a view of (1-bit LAMB section 4.2), so the compression stage makes one
compressed allreduce per step.  Communication runs through the job's context
(``context.current().execute``) as named engine requests, ordered with every other collective on
every rank, or directly on an explicit ``topology``.

Elements whose frozen variance is exactly 0 (no gradient in the whole warm-up: a dead unit, an
unused embedding row) have their momentum held at 0 on both sides of the compressed allreduce,
so they take no momentum step; see ``OnebitAdam``'s module docstring for why.
"""
import itertools
import logging
import weakref
from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch

from horovod_ext.backends import context
from horovod_ext.backends.topology import Topology

from horovod_ext.backends.base import allreduce_average_

from .compressed_allreduce import (ErrorFeedback, compressed_allreduce_,
                                   hierarchical_average_, hierarchical_compressed_allreduce_)

_COUNTERS: Dict[str, "itertools.count"] = defaultdict(itertools.count)


class _Fused:
    """Parameters of one (device, dtype) with their momenta as views of one flat buffer."""

    def __init__(self, params: List[torch.Tensor], flat: torch.Tensor):
        self.params = params
        self.flat = flat
        self.lengths = [p.numel() for p in params]
        self.errors = ErrorFeedback()
        # flat indices where the frozen variance is 0; found at the first compressed step,
        # when the variance no longer changes
        self.frozen_zeros: Optional[torch.Tensor] = None

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(torch.split(flat, self.lengths), self.params)]

    def hold_frozen_zeros(self, state) -> None:
        """Set the momentum to 0 where the frozen variance is 0.  1-bit compression cannot send
        a 0, and ``sign * scale / (sqrt(0) + eps)`` would throw such an element ~scale/eps
        away.  Every rank holds the same elements: the variance comes from gradients averaged
        at full precision, the same on every rank."""
        if self.frozen_zeros is None:
            zero = torch.cat([(state[p]["exp_avg_sq"] == 0).reshape(-1) for p in self.params])
            self.frozen_zeros = zero.nonzero().squeeze(1)
            if self.frozen_zeros.numel():
                logging.getLogger("horovod_ext").warning(
                    "1-bit: %d of %d elements had no gradient during the warm-up (their frozen "
                    "variance is 0); they take no step from now on. If they should train, "
                    "freeze later (a larger freeze_step) or check why their gradients are 0",
                    self.frozen_zeros.numel(), zero.numel())
        if self.frozen_zeros.numel():
            self.flat.index_fill_(0, self.frozen_zeros, 0.0)


class OnebitOptimizer(torch.optim.Optimizer):
    """Base class: warm-up with full-precision gradient averaging, then compressed momentum."""

    def __init__(self, params, defaults: dict, freeze_step: int,
                 topology: Optional[Topology] = None, hierarchical: Optional[bool] = None,
                 name: Optional[str] = None):
        super().__init__(params, defaults)
        if int(freeze_step) != freeze_step or freeze_step < 1:
            raise ValueError(f"freeze_step must be an integer >= 1, got {freeze_step!r}: the "
                             f"frozen variance comes from at least one warm-up step")
        self.freeze_step = int(freeze_step)
        self._topology = topology
        self._hierarchical = hierarchical
        kind = type(self).__name__
        self._name = name or f"{kind}.{next(_COUNTERS[kind])}"
        self._fused: Optional[List[_Fused]] = None
        # Step counter and stage, for the whole optimizer (saved in state_dict()["onebit"]).
        self.onebit_state = {"step": 0, "frozen": False, "freeze_at": None}
        self._saved_errors: Optional[list] = None
        self._errors_topology = None   # weak reference: the topology the errors were made in

    # --- public inspection -----------------------------------------------------------------
    @property
    def frozen(self) -> bool:
        """True once the warm-up has ended (variance frozen, momentum compressed)."""
        return self.onebit_state["frozen"]

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent in compressed allreduces (the warm-up is not counted)."""
        return sum(f.errors.bytes_sent for f in self._fused or [])

    # --- fusion -----------------------------------------------------------------------------
    def _all_params(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _begin_step(self, closure):
        """Evaluate ``closure`` (with gradients on), build the fused momenta if needed, count
        the step: (loss, fused buffers, step number from 1)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused = self._fuse()
        self.onebit_state["step"] += 1
        return loss, fused, self.onebit_state["step"]

    def _groups(self):
        """(param group, parameter) for every parameter, in param_groups order."""
        return [(g, p) for g in self.param_groups for p in g["params"]]

    def _averaged_grads_by_param(self, fused) -> Dict[int, torch.Tensor]:
        """id(parameter) -> its gradient averaged over ranks at full precision (warm-up)."""
        return {id(p): g for f, views in zip(fused, self._averaged_grads(fused))
                for p, g in zip(f.params, views)}

    def _fuse(self) -> List[_Fused]:
        """Build the flat momentum buffers (first step, or after load_state_dict)."""
        if self._fused is not None:
            return self._fused
        by_kind: Dict[tuple, List[torch.Tensor]] = {}
        for p in self._all_params():
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        fused = []
        for params in by_kind.values():
            for p in params:
                self._init_state(p, self.state[p])
            flat = torch.cat([self.state[p]["exp_avg"].reshape(-1) for p in params])
            f = _Fused(params, flat)
            for p, view in zip(params, f.views(flat)):
                self.state[p]["exp_avg"] = view
            fused.append(f)
        if self._saved_errors is not None:
            for f, saved in zip(fused, self._saved_errors):
                if saved is not None:
                    f.errors.load_state_dict(saved)
            self._saved_errors = None
        self._fused = fused
        return fused

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    # --- communication ------------------------------------------------------------------------
    def _communicate(self, what: str, fn: Callable[[Topology], None]) -> None:
        """Run fn(topology) on every rank, ordered with the job's other collectives."""
        if self._topology is not None:
            fn(self._topology)
            return
        ctx = context.current()
        if ctx.topology.size == 1:
            fn(ctx.topology)
        else:
            ctx.execute(f"{self._name}.{what}", fn)

    def _hierarchical_on(self, topology: Topology) -> bool:
        flag = self._hierarchical
        if flag is None:
            flag = self._topology is None and context.current().hierarchical_allreduce
        return bool(flag) and topology.hierarchy_applies

    def _averaged_grads(self, fused: List[_Fused]) -> List[List[torch.Tensor]]:
        """Full-precision averages of the gradients (zeros where a rank has none), per fused
        buffer, as views shaped like the parameters."""
        flats = [torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                            for p in f.params]) for f in fused]

        def average(topology):
            hier = self._hierarchical_on(topology)
            for flat in flats:
                if hier:   # as the compressed stage: a node sends its gradients across once
                    hierarchical_average_(flat, topology)
                else:
                    allreduce_average_(flat, topology.world)
        self._communicate("grad", average)
        return [f.views(flat) for f, flat in zip(fused, flats)]

    def _compress_momentum(self, fused: List[_Fused], per_layer_scales: bool) -> None:
        """Replace every flat momentum by its compressed average (one call per buffer), the
        elements whose frozen variance is 0 held at 0 before and after it."""
        for f in fused:
            # before: a gradient such an element gets after the warm-up would pile up in the
            # worker error (its share of the output is discarded), which would then swell its
            # layer's scale; held at 0, its error stays within one scale
            f.hold_frozen_zeros(self.state)

        def run(topology):
            hier = self._hierarchical_on(topology)
            made_in = self._errors_topology() if self._errors_topology is not None else None
            if made_in is not topology:
                # Another world (an elastic job re-formed, hvd.init() again): every rank's
                # share of the server error belongs to the old ranks, and a worker error was
                # made for the old average.  Both start again from zero.
                if self._errors_topology is not None:
                    for f in fused:
                        f.errors.reset()
                self._errors_topology = weakref.ref(topology)
            for f in fused:
                lengths = f.lengths if per_layer_scales else None
                if hier:
                    hierarchical_compressed_allreduce_(f.flat, topology, f.errors, lengths)
                else:
                    compressed_allreduce_(f.flat, topology.world, f.errors, lengths)
        self._communicate("momentum", run)
        for f in fused:
            f.hold_frozen_zeros(self.state)

    @staticmethod
    def _local_grad(p: torch.Tensor) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    @staticmethod
    def _apply_mask(group: dict, p: torch.Tensor, exp_avg: torch.Tensor) -> None:
        """DeepSpeed's ``exp_avg_mask``: a 0/1 tensor per group (shaped like its parameters, or
        a dict from parameter to mask) zeroing momentum entries that must stay exactly 0, which
        1-bit compression cannot represent."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return
        if isinstance(mask, dict):
            mask = mask.get(p)
            if mask is None:
                return
        exp_avg.mul_(mask.to(device=exp_avg.device, dtype=exp_avg.dtype))

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Also this rank's worker and server errors: save one file per rank."""
        sd = super().state_dict()
        sd["onebit"] = dict(self.onebit_state,
                            errors=[f.errors.state_dict() for f in self._fused]
                            if self._fused is not None else None)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            extra = dict(extra)
            self._saved_errors = extra.pop("errors")
            self.onebit_state = extra
        self._fused = None  # momenta are no longer views of a flat buffer: fuse again
