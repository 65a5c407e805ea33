"""``hvd.DiLoCo``: local training with a periodic outer step (Douillard et al., 2023, DiLoCo;
local SGD when ``outer_lr=1, outer_momentum=0``; the streaming form of Douillard et al., 2025,
with ``fragments > 1``).

Each rank runs the inner optimizer on its own data; every ``sync_every`` inner steps the
pseudo-gradient (the parameters at the start of the round minus the current ones) is reduced
with ``op`` (any registry op: Average, or a compressed one such as ``hvd.OneBit``), and an outer
SGD step with (Nesterov) momentum moves the round's starting parameters, which every rank then
continues from.  Communication happens once per round instead of once per step.

Streaming: ``fragments=F`` cuts the parameters into F consecutive parts of about equal size;
fragment f syncs at inner steps (f + 1) H / F + k H, so the exchanges are spread over the round
and each is 1/F of the model.  With ``overlap_steps=tau`` a fragment's reduction runs while the
next tau inner steps compute; its outer step is then applied and the fragment's parameters,
which moved on meanwhile, become ``mixing * local + (1 - mixing) * outer`` (0.5: the paper's
choice).  ``overlap_steps=0`` replaces them by the outer result, as plain DiLoCo does.

The parameters must be equal on every rank when it is built (call ``hvd.broadcast_parameters``
first).  ``state_dict()`` holds the inner optimizer's state, each fragment's round start, the
outer momentum, any reduction still in flight (waited for: its result is stored) and the step
counts: a resumed run continues bitwise, and ``hvd.elastic.TorchState`` restores and shares it
when the job re-forms.
"""
from typing import Dict, List, Tuple

import torch

from horovod_ext.engine import HorovodInternalError
from horovod_ext.ops import Average, get_op
from horovod_ext.backends.partition import balanced_parts
from horovod_ext.engine.process_sets import global_process_set
from .mpi_ops import allreduce_async_, synchronize
from .param_names import name_parameters


class DiLoCo:
    """Wraps ``optimizer``; ``step()`` is an inner step, and every ``sync_every``-th one (per
    fragment, at staggered steps) also the outer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 sync_every: int = 500, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, op=Average, fragments: int = 1, overlap_steps: int = 0,
                 mixing: float = 0.5, process_set=global_process_set):
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"DiLoCo sync_every must be a positive integer, got {sync_every!r}")
        if outer_lr <= 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"DiLoCo needs outer_lr > 0 and 0 <= outer_momentum < 1, got "
                             f"{outer_lr!r} and {outer_momentum!r}")
        if not isinstance(overlap_steps, int) or not 0 <= overlap_steps < sync_every:
            raise ValueError(f"DiLoCo overlap_steps must be an integer in [0, sync_every), got "
                             f"{overlap_steps!r}: a fragment's reduction must be applied before "
                             f"its next one starts")
        if not 0 <= mixing <= 1:
            raise ValueError(f"DiLoCo mixing must be in [0, 1], got {mixing!r}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        named = name_parameters(params, named_parameters)
        if not isinstance(fragments, int) or not 1 <= fragments <= min(len(named), sync_every):
            raise ValueError(f"DiLoCo fragments must be an integer from 1 to the number of "
                             f"parameters ({len(named)}) and at most sync_every ({sync_every}), "
                             f"got {fragments!r}")
        self.optimizer = optimizer
        self.named: List[Tuple[str, torch.Tensor]] = named
        self.params: Dict[str, torch.Tensor] = dict(named)
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.overlap_steps = overlap_steps
        self.mixing = float(mixing)
        self.op = get_op(op)
        self.process_set = process_set
        self.fragments: List[List[str]] = [
            [named[i][0] for i in part]
            for part in balanced_parts([p.numel() for _, p in named], fragments)]
        # fragment f syncs at offset[f] + k * sync_every: one fragment: every sync_every steps
        self.offsets = [(f + 1) * sync_every // fragments for f in range(fragments)]
        with torch.no_grad():
            self.anchor: Dict[str, torch.Tensor] = {n: p.detach().clone() for n, p in named}
        self.momentum: Dict[str, torch.Tensor] = {}
        # fragment -> (inner step it is applied at, [(name, handle or reduced tensor)])
        self.pending: Dict[int, Tuple[int, list]] = {}
        self.inner_steps = 0
        self.outer_steps = 0

    # --- the inner optimizer's interface ---------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.inner_steps += 1
        now = self.inner_steps
        for f in sorted(f for f, (due, _) in self.pending.items() if due == now):
            self._finish(f)
        for f, offset in enumerate(self.offsets):
            if now >= offset and (now - offset) % self.sync_every == 0:
                self._start(f)
                if self.overlap_steps == 0:
                    self._finish(f)
        return loss

    # --- the outer step ----------------------------------------------------------------------
    @torch.no_grad()
    def sync(self):
        """Finish every reduction in flight, then reduce every fragment's pseudo-gradient and
        take its outer step now; every rank ends with the same parameters."""
        for f in sorted(self.pending):
            self._finish(f, replace=True)
        for f in range(len(self.fragments)):
            self._start(f)
            self._finish(f, replace=True)

    @torch.no_grad()
    def _start(self, f: int):
        reductions = []
        for name in self.fragments[f]:
            delta = self.anchor[name] - self.params[name]
            reductions.append((name, allreduce_async_(delta, name=f"diloco.{name}", op=self.op,
                                                      process_set=self.process_set)))
        self.pending[f] = (self.inner_steps + self.overlap_steps, reductions)

    @torch.no_grad()
    def _finish(self, f: int, replace: bool = False):
        _, reductions = self.pending.pop(f)
        for name, handle in reductions:
            reduced = handle if isinstance(handle, torch.Tensor) else synchronize(handle)
            update = reduced
            if self.outer_momentum:
                buf = self.momentum.get(name)
                if buf is None:
                    buf = self.momentum[name] = reduced.clone()
                else:
                    buf.mul_(self.outer_momentum).add_(reduced)
                update = reduced.add(buf, alpha=self.outer_momentum) if self.nesterov else buf
            self.anchor[name].sub_(update, alpha=self.outer_lr)
            p = self.params[name]
            if self.overlap_steps == 0 or replace:
                p.copy_(self.anchor[name])
            else:   # the parameters moved on while the reduction ran: mix the two
                p.mul_(self.mixing).add_(self.anchor[name], alpha=1 - self.mixing)
        self.outer_steps += 1

    # --- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        pending = {}
        for f, (due, reductions) in self.pending.items():
            done = [(n, h if isinstance(h, torch.Tensor) else synchronize(h))
                    for n, h in reductions]
            self.pending[f] = (due, done)        # waited for once; kept for step()
            pending[f] = (due, [(n, t.clone()) for n, t in done])
        return {"inner": self.optimizer.state_dict(),
                "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "momentum": {n: t.clone() for n, t in self.momentum.items()},
                "pending": pending,
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                "settings": self._settings()}

    def _settings(self) -> dict:
        return {"sync_every": self.sync_every, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "nesterov": self.nesterov,
                "op": self.op.name, "fragments": len(self.fragments),
                "overlap_steps": self.overlap_steps, "mixing": self.mixing}

    def load_state_dict(self, state: dict) -> None:
        mine = self._settings()
        if state["settings"] != mine:
            raise ValueError(f"a DiLoCo state saved with {state['settings']} cannot be loaded "
                             f"into one with {mine}")
        for _, reductions in self.pending.values():   # drained: their names become free
            for _, handle in reductions:
                if not isinstance(handle, torch.Tensor):
                    try:
                        synchronize(handle)
                    except HorovodInternalError:
                        pass   # the job lost a rank (hvd.elastic restores): nothing to drain
        self.optimizer.load_state_dict(state["inner"])
        with torch.no_grad():
            for name, tensor in state["anchor"].items():
                self.anchor[name].copy_(tensor)
        self.momentum = {n: t.clone() for n, t in state["momentum"].items()}
        self.pending = {int(f): (due, [(n, t.clone()) for n, t in reductions])
                        for f, (due, reductions) in state["pending"].items()}
        self.inner_steps, self.outer_steps = state["inner_steps"], state["outer_steps"]
