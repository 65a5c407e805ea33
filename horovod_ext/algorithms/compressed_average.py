"""The error-fed compressed average over the ranks of a communicator, for any
``codes.ByteCompressor`` (SparseLoCo's chunked top-k, the chunked quantiser).

For each tensor x (a layer, or the part of one a rank reduces) with its error e:
e = decay * e + x; the message m = compress(e); e = e - decompress(m); and the result is the
mean over ranks of decompress(m_r).  All of a call's messages travel in one allgather (their
lengths depend only on the tensors' sizes, so every rank's are alike); every rank adds the
ranks' values in rank order, so all hold the same bits.  ``decay`` < 1 is SparseLoCo's error
feedback with its decay, which takes the place of the outer momentum; 1 keeps every error, and 0
keeps none (plain compression).
"""
import itertools
from typing import Dict, Hashable, List, Sequence, Tuple

import torch

from horovod_ext.backends.base import Communicator

from .codes import ByteCompressor


class ErrorFeedback:
    """Per tensor name, what compression has not sent yet (float32 or wider, on the tensor's
    device, the tensor's whole length: a call may bring any part of it), and the bytes this rank
    has put into messages."""

    def __init__(self):
        self.errors: Dict[Hashable, torch.Tensor] = {}
        self.bytes_sent = 0

    def error_of(self, piece: "Piece") -> torch.Tensor:
        """The error of ``piece``'s elements (a view into its tensor's error)."""
        name, numel, start, x = piece
        error = self.errors.get(name)
        if error is None or error.numel() != numel or error.device != x.device:
            error = self.errors[name] = torch.zeros(
                numel, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        return error[start:start + x.numel()]

    def state_dict(self) -> dict:
        return {"errors": [(key, e.clone()) for key, e in self.errors.items()],
                "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict):
        self.errors = {key: e.clone() for key, e in state["errors"]}
        self.bytes_sent = state["bytes_sent"]


# (name, numel, start, x): x holds elements [start, start + len(x)) of the 1-D tensor of
# ``numel`` elements called ``name``; its error is kept under that name.
Piece = Tuple[Hashable, int, int, torch.Tensor]


def compressed_average_(pieces: Sequence[Piece], feedback: ErrorFeedback, comm: Communicator,
                        config: ByteCompressor, decay: float) -> None:
    """Replace each 1-D float tensor of ``pieces`` by the mean over the ranks of ``comm`` of
    their compressed, error-fed values, in place."""
    messages: List[torch.Tensor] = []
    sent: List[torch.Tensor] = []   # what this rank's messages stand for, decompressed once
    for piece in pieces:
        x = piece[3]
        error = feedback.error_of(piece).mul_(decay).add_(x) if decay else x
        message = config.compress(error)
        sent.append(config.decompress(message, x.numel()))
        if decay:
            error.sub_(sent[-1])
        messages.append(message)
    mine = torch.cat(messages) if messages else torch.empty(0, dtype=torch.uint8)
    feedback.bytes_sent += mine.numel()
    if comm.size > 1 and mine.numel():
        everyone = comm.allgather(mine.view(1, -1), [1] * comm.size)
    else:
        everyone = mine.view(1, -1)
    starts = itertools.accumulate((len(m) for m in messages), initial=0)
    for (*_, x), mine_dense, start, message in zip(pieces, sent, starts, messages):
        x.zero_()
        for rank, row in enumerate(everyone):   # in rank order on every rank: the same bits
            if rank == comm.rank:
                x.add_(mine_dense.to(x.dtype))
            else:
                config.decompress(row[start:start + len(message)], x.numel(), out=x, add=True)
        x.div_(comm.size)

