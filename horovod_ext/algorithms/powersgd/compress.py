"""One PowerSGD round over a communicator, as torch's ``powerSGD_hook`` does it per bucket.

For the tensors of one fused buffer (its layers), on every rank:

1. with error feedback, add this rank's error (what earlier rounds failed to send) to the buffer
   and keep a copy of the sum, ``M``;
2. 1-D tensors, and matrices (a tensor viewed as ``shape[0]`` x the rest) that rank ``r`` does
   not shrink by more than ``min_compression_rate`` ((n + m) r >= n m / rate), are averaged in
   full;
3. for each other matrix ``M`` (n x m): ``P = M Q`` with this layer's ``Q`` (m x r: random, the
   same on every rank, in the first round or every round without warm start; else last round's
   ``Q``, orthogonalised); the ``P`` of all matrices are summed in the same allreduce as the
   tensors of step 2 and orthogonalised, ``Q = M^T P`` averaged in a second allreduce, and
   ``M`` replaced by ``P Q^T`` (torch's hook needs three allreduces: it sends step 2's tensors
   on their own);
4. with error feedback, the new error is ``M`` (step 1) minus the result, over the whole buffer
   (so a fully averaged tensor keeps ``local - average``, as in torch's hook).

Before ``start_iter`` rounds of a buffer it is averaged in full (and its error starts at zero).
With ``batch_tensors_with_same_shape`` (torch's option of that name) the matrices of one shape
are stacked and multiplied with one ``bmm`` each time instead of one per matrix: fewer, larger
kernels for models with many equal layers; the same result up to rounding.
"""
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import Communicator, ReduceOp, allreduce_average_


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether an n x m matrix is worth sending as rank-``rank`` factors."""
    return (n + m) * rank * min_compression_rate < n * m


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of each matrix of the batch ``matrices`` (b x n x r, r <= n),
    in place: Gram-Schmidt for r <= 2 or half precision, QR otherwise (as torch's hook)."""
    r = matrices.shape[2]
    if r <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrices[:, :, i:i + 1]
            if epsilon == 0:
                col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True))
            else:
                col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True) + epsilon)
            if i + 1 < r:
                rest = matrices[:, :, i + 1:]
                rest.sub_(col * (col * rest).sum(dim=1, keepdim=True))
        return matrices
    q, _ = torch.linalg.qr(matrices)
    return matrices.copy_(q)


@dataclass
class _Batch:
    """Matrices of one shape (n x m, factors of rank r) compressed together: where each sits in
    the buffer, and where their factors sit (back to back) in the P and Q memories."""
    offsets: List[int]
    n: int
    m: int
    r: int
    p_at: int
    q_at: int


@dataclass
class _Plan:
    full: torch.Tensor                   # the buffer positions of the tensors averaged in full
    matrices: List[_Batch]
    p_numel: int
    q_numel: int


@dataclass
class PowerSGDState:
    """One fused buffer's state on this rank: its error, its Q memory and its round count."""
    error: torch.Tensor = None
    q: torch.Tensor = None
    rounds: int = 0
    bytes_sent: int = 0
    plan: _Plan = field(default=None, repr=False)

    def state_dict(self) -> dict:
        return {"error": self.error, "q": self.q, "rounds": self.rounds,
                "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict) -> None:
        self.error, self.q = state["error"], state["q"]
        self.rounds, self.bytes_sent = state["rounds"], state["bytes_sent"]
        self.plan = None


def _plan(shapes: Sequence[Tuple[int, ...]], numels: Sequence[int], rank: int,
          min_compression_rate: float, batch_same_shape: bool, device) -> _Plan:
    full, compressed = [], []
    offset = 0
    for shape, numel in zip(shapes, numels):
        if len(shape) >= 2 and numel:
            n = shape[0]
            m = numel // n
            r = min(n, m, rank)
            if should_compress(n, m, r, min_compression_rate):
                compressed.append((offset, n, m, r))
                offset += numel
                continue
        full.append(torch.arange(offset, offset + numel))
        offset += numel
    batches: Dict[Tuple[int, ...], _Batch] = {}   # in order of first appearance
    p_at = q_at = 0
    for i, (at, n, m, r) in enumerate(compressed):
        batch = batches.setdefault((n, m, r) if batch_same_shape else (i,),
                                   _Batch([], n, m, r, 0, 0))
        batch.offsets.append(at)
    for batch in batches.values():
        batch.p_at, batch.q_at = p_at, q_at
        p_at += len(batch.offsets) * batch.n * batch.r
        q_at += len(batch.offsets) * batch.m * batch.r
    full_index = torch.cat(full) if full else torch.empty(0, dtype=torch.long)
    return _Plan(full_index.to(device), list(batches.values()), p_at, q_at)


def _random_q(numel: int, seed: int, key: str, rounds: int, dtype, device) -> torch.Tensor:
    """The same random numbers on every rank: seeded by (seed, layer names, round)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}/{rounds}".encode()))
    return torch.randn(numel, generator=g, dtype=dtype).to(device)


def _ring_bytes(numel: int, element_size: int, size: int) -> int:
    """What one rank sends in a ring allreduce of ``numel`` elements over ``size`` ranks."""
    return 2 * (size - 1) * numel * element_size // size


def _add_error(buffer: torch.Tensor, state: PowerSGDState) -> torch.Tensor:
    """Step 1: the buffer plus this rank's error, and a copy of that sum (``M``)."""
    if state.error is None:
        state.error = torch.zeros_like(buffer)
    buffer.add_(state.error)
    return buffer.clone()


def _factor_views(buffer: torch.Tensor, p: torch.Tensor, state: PowerSGDState, plan: _Plan,
                  warm_start: bool, seed: int, key: str, round_index: int) -> list:
    """Per batch of matrices: (the matrices as b x n x m, its P in ``p``, its Q in the Q memory,
    the batch); fills the Q memory with the same random numbers on every rank when fresh."""
    fresh = state.q is None or not warm_start
    if state.q is None:
        state.q = torch.empty(plan.q_numel, dtype=buffer.dtype, device=buffer.device)
    if fresh:
        state.q.copy_(_random_q(plan.q_numel, seed, key, round_index, buffer.dtype,
                                buffer.device))
    views = []
    for batch in plan.matrices:
        b, n, m, r = len(batch.offsets), batch.n, batch.m, batch.r
        if b == 1:     # the buffer's own slice: the result is written in place
            mat = buffer[batch.offsets[0]:batch.offsets[0] + n * m].view(1, n, m)
        else:          # matrices of one shape stacked, for one bmm instead of b
            mat = torch.stack([buffer[o:o + n * m].view(n, m) for o in batch.offsets])
        pv = p[batch.p_at:batch.p_at + b * n * r].view(b, n, r)
        qv = state.q[batch.q_at:batch.q_at + b * m * r].view(b, m, r)
        views.append((mat, pv, qv, batch))
    return views


def _send_q_and_rebuild(buffer: torch.Tensor, views: list, state: PowerSGDState,
                        comm: Communicator, orthogonalization_epsilon: float) -> None:
    """Q = M^T P (P orthogonalised) averaged over ``comm``, then M = P Q^T in the buffer."""
    with trace.activity("POWERSGD_Q", state.q.numel() * state.q.element_size()):
        for mat, pv, qv, _ in views:
            orthogonalize_(pv, orthogonalization_epsilon)
            torch.bmm(mat.transpose(1, 2), pv, out=qv)
        allreduce_average_(state.q, comm)
    for mat, pv, qv, batch in views:
        torch.bmm(pv, qv.transpose(1, 2), out=mat)
        if len(batch.offsets) > 1:
            for o, result in zip(batch.offsets, mat):
                buffer[o:o + batch.n * batch.m].copy_(result.view(-1))


def powersgd_allreduce_(buffer: torch.Tensor, shapes: Sequence[Tuple[int, ...]],
                        numels: Sequence[int], comm: Communicator, state: PowerSGDState,
                        rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                        warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                        use_error_feedback: bool = True, seed: int = 0,
                        batch_tensors_with_same_shape: bool = False,
                        key: str = "") -> torch.Tensor:
    """Replace the flat ``buffer`` (tensors of ``shapes`` back to back) by its PowerSGD average
    over ``comm``; ``state`` is this buffer's state on this rank, ``key`` names the buffer (the
    random Q depends on it).  Returns ``buffer``."""
    round_index = state.rounds   # torch's state.iter: the first start_iter rounds are plain
    state.rounds += 1
    if round_index < start_iter or comm.size == 1:
        state.bytes_sent += _ring_bytes(buffer.numel(), buffer.element_size(), comm.size)
        return allreduce_average_(buffer, comm)
    if state.plan is None:
        state.plan = _plan(shapes, numels, rank, min_compression_rate,
                           batch_tensors_with_same_shape, buffer.device)
    plan = state.plan
    if use_error_feedback:
        before = _add_error(buffer, state)
    # The tensors averaged in full travel in the same allreduce as P (a sum: P is
    # orthogonalised next, so it need not be averaged): one collective fewer per round.
    full = plan.full.numel()
    first = torch.empty(full + plan.p_numel, dtype=buffer.dtype, device=buffer.device)
    torch.index_select(buffer, 0, plan.full, out=first[:full])
    views = []
    if plan.matrices:
        views = _factor_views(buffer, first[full:], state, plan, warm_start, seed, key,
                              round_index)
    with trace.activity("POWERSGD_FULL_AND_P", first.numel() * first.element_size()):
        for mat, pv, qv, _ in views:
            orthogonalize_(qv, orthogonalization_epsilon)
            torch.bmm(mat, qv, out=pv)
        comm.allreduce(first, ReduceOp.SUM)
        first[:full].div_(comm.size)
        buffer.index_copy_(0, plan.full, first[:full])
    if plan.matrices:
        _send_q_and_rebuild(buffer, views, state, comm, orthogonalization_epsilon)
    state.bytes_sent += _ring_bytes(full + plan.p_numel + plan.q_numel, buffer.element_size(),
                                    comm.size)
    if use_error_feedback:
        torch.sub(before, buffer, out=state.error)
    return buffer
