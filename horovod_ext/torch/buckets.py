"""Gradient buckets: flat buffers whose slices are the parameters' ``.grad``.

DistributedOptimizer with an elementwise op (Sum, Average, Min, Max, Product) lays the gradients
of consecutive parameters out back to back in one flat buffer per bucket and points each
parameter's ``.grad`` at its slice, as DDP's ``gradient_as_bucket_view`` does.  Autograd then
accumulates straight into the bucket, and a bucket is reduced in place with one collective once
all its gradients are in: no packing or unpacking copies, and a few large transfers instead of
one per tensor (each call has a fixed latency, whatever its size).

Buckets follow the reverse of the parameter order (the order backward usually produces gradients
in) for the first step, and from then on the order the gradients did arrive in, rank 0's, as DDP
rebuilds its buckets (reduction.follow_arrival_order: a bucket waits for its last gradient, and a
pre-LN transformer layer registers its first norm after the linear layers that backward reaches
before it). From the fifth step on they are either cut from what was measured at the second to
fourth (bucket_timing.py: when each gradient arrived, its median over those backward passes, and
what a reduction costs, so that the last reduction ends earliest) or set by size, and by
default (HOROVOD_GRADIENT_BUCKET_PLAN=auto) the one that trains clearly faster stays
(reduction/plan_trial.py; on one host, the size buckets). No bucket holds more than
HOROVOD_GRADIENT_BUCKET_BYTES (default 25 MiB, as DDP's ``bucket_cap_mb``; capped by
HOROVOD_FUSION_THRESHOLD; either at 0 turns buckets off and every gradient is its own request,
as in Horovod). By size, the first bucket, backward's first gradients, closes once it holds
HOROVOD_FIRST_BUCKET_BYTES (1 MiB by default; 0: it is capped as the others), the gradient that
crosses that size included (within the cap), as DDP cuts its first bucket: its reduction starts
while backward goes on, and where a large gradient follows a few small ones (an MLP's 4 MB
hidden layer after its 40 KB output layer) it still carries half the model, not only the small
ones. The rest hold up to the cap. A ``.grad`` that is not the bucket's slice when it is ready
(after ``zero_grad(set_to_none=True)``, the default, a user's assignment, ``create_graph``
backward) is copied in and the slice takes its place. The default zero_grad relies on that on
purpose: one copy of autograd's fresh gradient costs less than zeroing the bucket and then
accumulating into it.  Where an average is the sum of gradients divided first, exactly
(reduction.state.Settings.bucket_divisor), that copy divides too, as DDP's does, and the
bucket is summed: no pass over it after the transfer."""
from typing import Dict, List, Sequence

import torch


class Bucket:
    """Parameters of one dtype and device whose gradients live in ``flat``."""

    def __init__(self, index: int, params: Sequence[torch.Tensor]):
        self.index = index
        self.params = list(params)
        first = self.params[0]
        total = sum(p.numel() for p in self.params)
        # one value more, after the gradients: the bucket's vote on a lane
        # (reduction/lane.py), summed with them there
        self.storage = torch.zeros(total + 1, dtype=first.dtype, device=first.device)
        self.flat = self.storage[:total]
        self.vote = self.storage[total:]
        self.views: Dict[int, torch.Tensor] = {}
        offset = 0
        for p in self.params:
            # plain slices, not split(): split's outputs are multi-output views, which
            # autograd refuses to modify in place when a gradient itself requires grad
            self.views[id(p)] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready: set = set()   # ids of parameters whose gradient is in, this step

    def adopt(self, p: torch.Tensor, sparse_ok: bool, name: str, divisor: int = 1):
        """Make ``p.grad`` the bucket's slice, keeping its value (zeros when it has none),
        divided by ``divisor``: in the copy, when there is one."""
        if torch.is_grad_enabled():   # a backward with create_graph=True
            with torch.no_grad():
                self._adopt(p, sparse_ok, name, divisor)
        else:   # backward's own mode: a context per gradient would cost more than its copy
            self._adopt(p, sparse_ok, name, divisor)

    def _adopt(self, p: torch.Tensor, sparse_ok: bool, name: str, divisor: int):
        view = self.views[id(p)]
        grad = p.grad
        if grad is not None and not grad.is_sparse and grad.data_ptr() == view.data_ptr() \
                and grad.shape == view.shape:
            if divisor != 1:
                view.div_(divisor)
            return
        if grad is None:
            view.zero_()
        else:
            if grad.is_sparse:
                if not sparse_ok:
                    raise ValueError(f"sparse gradient for {name}: pass sparse_as_dense=True")
                grad = grad.to_dense()
            if divisor != 1:
                torch.div(grad, divisor, out=view)
            else:
                view.copy_(grad)
        p.grad = view

    def zero_(self):
        self.flat.zero_()


def plan(params: Sequence[torch.Tensor], cap: int, first_cap: int = 0) -> List[Bucket]:
    """Buckets of at most ``cap`` bytes (a bigger tensor alone) over ``params`` in reverse
    order, split where dtype or device changes; the first closes as soon as it holds
    ``first_cap``, when set."""
    return [Bucket(i, members) for i, members in enumerate(partition(params, cap, first_cap))]


def partition(params: Sequence[torch.Tensor], cap: int,
              first_cap: int = 0) -> List[List[torch.Tensor]]:
    """The parameters of each bucket ``plan`` makes, without allocating them."""
    groups: List[List[torch.Tensor]] = []
    current: List[torch.Tensor] = []
    used = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and ((p.dtype, p.device) != (current[0].dtype, current[0].device)
                        or used + nbytes > cap):
            groups.append(current)
            current, used = [], 0
        current.append(p)
        used += nbytes
        if first_cap and not groups and used >= first_cap:
            groups.append(current)
            current, used = [], 0
    if current:
        groups.append(current)
    return groups


def eligible(params: Sequence[torch.Tensor]) -> bool:
    """Dense, strided parameters only (a bucket slice cannot stand in for anything else)."""
    return all(p.layout == torch.strided and not p.is_sparse for p in params)
