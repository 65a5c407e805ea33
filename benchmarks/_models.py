"""A BERT-like encoder with a masked-language-model head, and synthetic MLM batches, for benchmarks.

Plain PyTorch, no horovod_ext: the benchmarks wrap it with the public API.  Shaped like BERT
(token + position embeddings, LayerNorm, post-LN encoder layers with GELU, an MLM transform and a
decoder tied to the token embedding), small enough for CPUs: the default of ``bert_like()``
(hidden 512, 6 layers, 8 heads, vocabulary 16384, 128 tokens) has 27.5 M parameters.
"""
from typing import Tuple

import torch
import torch.nn.functional as F

MASK_ID = 4                 # ids below 5 are "special tokens" that synthetic text never uses
MASK_FRACTION = 0.15        # BERT masks 15% of the tokens


class BertLike(torch.nn.Module):
    def __init__(self, vocab: int = 16384, hidden: int = 512, layers: int = 6, heads: int = 8,
                 seq: int = 128, ffn: int = 0):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(seq, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        # Dropout 0: the methods are compared step for step, so no randomness beyond the data.
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, ffn or 4 * hidden, dropout=0.0,
                                                 activation="gelu", batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.transform = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                             torch.nn.LayerNorm(hidden))
        self.out_bias = torch.nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """Logits at the flat positions ``masked`` of ``tokens`` (batch, seq) only: as in BERT's
        pre-training code, the vocabulary projection runs on the masked tokens alone."""
        h = self.tok(tokens) + self.pos.weight[:tokens.shape[1]]
        h = self.body(self.norm(h))
        h = self.transform(h.flatten(0, 1)[masked])
        return F.linear(h, self.tok.weight, self.out_bias)


def bert_like(size: str = "base", **overrides) -> BertLike:
    """``size``: "base" (27.5 M parameters, default), "large" (46.6 M) or "tiny" (1.2 M, for
    quick runs); keyword arguments override single dimensions."""
    presets = {"tiny": dict(vocab=4096, hidden=128, layers=2, heads=4, seq=64),
               "base": dict(vocab=16384, hidden=512, layers=6, heads=8, seq=128),
               "large": dict(vocab=16384, hidden=640, layers=8, heads=10, seq=128)}
    if size not in presets:
        raise ValueError(f"unknown model size {size!r}: one of {sorted(presets)}")
    return BertLike(**{**presets[size], **{k: v for k, v in overrides.items() if v}})


def mlm_batch(model: BertLike, batch: int, generator: torch.Generator
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens with [MASK] at the masked positions, flat masked positions, their labels).

    Exactly ``MASK_FRACTION`` of each batch's tokens are masked, so every step does the same
    work."""
    tokens = torch.randint(5, model.vocab, (batch, model.seq), generator=generator)
    n = tokens.numel()
    masked = torch.randperm(n, generator=generator)[:max(1, int(MASK_FRACTION * n))]
    labels = tokens.view(-1)[masked].clone()
    tokens.view(-1)[masked] = MASK_ID
    return tokens, masked, labels


def mlm_loss(model: BertLike, data) -> torch.Tensor:
    tokens, masked, labels = data
    return F.cross_entropy(model(tokens, masked), labels)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class CharLM(torch.nn.Module):
    """A small causal transformer over bytes (vocabulary 256): pre-LN decoder layers, learned
    positions, output tied to the embedding.  The default (hidden 128, 2 layers, 4 heads,
    context 64) has 0.42 M parameters."""

    CONTEXT = 64

    def __init__(self, hidden: int = 128, layers: int = 2, heads: int = 4, seq: int = CONTEXT):
        super().__init__()
        self.seq = seq
        self.tok = torch.nn.Embedding(256, hidden)
        self.pos = torch.nn.Embedding(seq, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                                 activation="gelu", batch_first=True,
                                                 norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(hidden)
        for table in (self.tok, self.pos):  # GPT-2's scale: unit-variance rows, tied to the
            torch.nn.init.normal_(table.weight, std=0.02)  # output, make logits in the tens
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte logits (batch, seq, 256) for ``tokens`` (batch, seq)."""
        n = tokens.shape[1]
        h = self.tok(tokens) + self.pos.weight[:n]
        h = self.body(h, mask=self.causal[:n, :n], is_causal=True)
        return F.linear(self.norm(h), self.tok.weight)


def lm_loss(model: CharLM, chunk: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-byte cross-entropy (nats) of ``chunk`` (batch, seq + 1) of byte ids."""
    logits = model(chunk[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), chunk[:, 1:].reshape(-1), reduction=reduction)
