"""``hvd.DiLoCo``: local training with a periodic outer step (Douillard et al., 2023, DiLoCo;
local SGD when ``outer_lr=1, outer_momentum=0``).

Each rank runs the inner optimizer on its own data; every ``sync_every`` inner steps the
pseudo-gradient (the parameters at the start of the round minus the current ones) is reduced
with ``op`` (any registry op: Average, or a compressed one such as ``hvd.OneBit``), and an outer
SGD step with (Nesterov) momentum moves the round's starting parameters, which every rank then
continues from.  Communication happens once per round instead of once per step.

The parameters must be equal on every rank when it is built (call ``hvd.broadcast_parameters``
first).  ``state_dict()`` holds the inner optimizer's state, the round's starting parameters,
the outer momentum and the step counts: a resumed run continues bitwise.
"""
from typing import Dict, List, Tuple

import torch

from ..ops import Average, get_op
from ..process_sets import global_process_set
from .mpi_ops import allreduce_async_, synchronize


class DiLoCo:
    """Wraps ``optimizer``; ``step()`` is an inner step, and every ``sync_every``-th one also
    the outer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 sync_every: int = 500, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, op=Average, fragments: int = 1,
                 process_set=global_process_set):
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"DiLoCo sync_every must be a positive integer, got {sync_every!r}")
        if outer_lr <= 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"DiLoCo needs outer_lr > 0 and 0 <= outer_momentum < 1, got "
                             f"{outer_lr!r} and {outer_momentum!r}")
        if fragments != 1:
            raise NotImplementedError("DiLoCo with fragments > 1 (streaming) is not provided; "
                                      "use fragments=1")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(params)]
        else:
            named = list(named_parameters)
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in known]
            if missing:
                raise ValueError(f"named_parameters does not name {len(missing)} of the "
                                 f"optimizer's parameters (positions {missing[:10]})")
            inner = {id(p) for p in params}
            named = [(n, p) for n, p in named if id(p) in inner]
        self.optimizer = optimizer
        self.named: List[Tuple[str, torch.Tensor]] = named
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.op = get_op(op)
        self.process_set = process_set
        with torch.no_grad():
            self.anchor: Dict[str, torch.Tensor] = {n: p.detach().clone() for n, p in named}
        self.momentum: Dict[str, torch.Tensor] = {}
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
        if self.inner_steps % self.sync_every == 0:
            self.sync()
        return loss

    # --- the outer step ----------------------------------------------------------------------
    @torch.no_grad()
    def sync(self):
        """Reduce the pseudo-gradients and take the outer step now (``step()`` calls this every
        ``sync_every`` inner steps); every rank ends with the same parameters."""
        pseudo = [(n, self.anchor[n] - p) for n, p in self.named]
        handles = [allreduce_async_(delta, name=f"diloco.{n}", op=self.op,
                                    process_set=self.process_set) for n, delta in pseudo]
        for (name, delta), handle in zip(pseudo, handles):
            reduced = synchronize(handle)
            update = reduced
            if self.outer_momentum:
                buf = self.momentum.get(name)
                if buf is None:
                    buf = self.momentum[name] = reduced.clone()
                else:
                    buf.mul_(self.outer_momentum).add_(reduced)
                update = reduced.add(buf, alpha=self.outer_momentum) if self.nesterov else buf
            self.anchor[name].sub_(update, alpha=self.outer_lr)
        for name, p in self.named:
            p.copy_(self.anchor[name])
        self.outer_steps += 1

    # --- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"inner": self.optimizer.state_dict(),
                "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "momentum": {n: t.clone() for n, t in self.momentum.items()},
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                "settings": {"sync_every": self.sync_every, "outer_lr": self.outer_lr,
                             "outer_momentum": self.outer_momentum, "nesterov": self.nesterov,
                             "op": self.op.name}}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()["settings"]
        if state["settings"] != mine:
            raise ValueError(f"a DiLoCo state saved with {state['settings']} cannot be loaded "
                             f"into one with {mine}")
        self.optimizer.load_state_dict(state["inner"])
        with torch.no_grad():
            for name, tensor in state["anchor"].items():
                self.anchor[name].copy_(tensor)
        self.momentum = {n: t.clone() for n, t in state["momentum"].items()}
        self.inner_steps, self.outer_steps = state["inner_steps"], state["outer_steps"]
