"""Transformer-style models written here (small sizes), for the tests of the layers
``iabn.convert`` replaces on their own (tests/conversion/test_convert_transformers.py) and the
``iabn memory`` commands of docs/usage/conversion.md (``transformer_models:decoder``).

- :class:`Decoder`: a Llama-style decoder: token embedding, blocks of RMSNorm, causal
  attention (``F.scaled_dot_product_attention``), a residual add, RMSNorm and a SwiGLU MLP
  (``down(silu(gate(h)) * up(h))``), a final RMSNorm and a linear head. The RMSNorms' inputs
  are the residual stream (read again by the addition), the SiLU's input is the gate
  projection's fresh output.
- :class:`MixerNet`: an MLP-mixer-like image model with ``nn.LayerNorm`` over channels, a
  GELU MLP and a tanh-GELU MLP, to check the layer norm and both GELU forms together.
"""

import torch.nn.functional as F
from torch import nn


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.act = nn.SiLU()
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(self.act(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, vocabulary: int = 64, dim: int = 32, heads: int = 4, hidden: int = 88,
                 depth: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads, hidden) for _ in range(depth))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocabulary, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def decoder() -> nn.Module:
    return Decoder()


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.token_norm = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(),
                                       nn.Linear(2 * tokens, tokens))
        self.channel_norm = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                         nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.token_norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.channel_norm(x))


class MixerNet(nn.Module):
    def __init__(self, dim: int = 24, patch: int = 4, size: int = 16, depth: int = 2,
                 classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock((size // patch) ** 2, dim)
                                      for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))


def mixer() -> nn.Module:
    return MixerNet()
