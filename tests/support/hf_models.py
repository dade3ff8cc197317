"""Small Hugging Face models (transformers 5.x, random weights, no download) for the
conversion's tests and ``benchmarks/hf_convert.py``, and the hand swap of their own norm and
activation classes for PyTorch's that the conversion is measured against.

Each family is ``(build, example)``: ``build(dtype)`` gives the model in training mode,
``example(dtype)`` the keyword arguments of its forward (``model(**example)``); both take a
``seed`` (default 0) for other random weights and batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

HIDDEN, LAYERS, HEADS, VOCAB, TOKENS = 64, 2, 4, 100, 16


def ids(dtype: torch.dtype, mask: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tokenizer's batch: ids and (``mask``) an attention mask of ones. Hugging Face's
    masking reads the mask's values (are they all ones?), so with it the conversion goes
    part by part (docs/usage/conversion.md)."""
    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(0, VOCAB, (2, TOKENS), generator=g)}
    if mask:
        batch["attention_mask"] = torch.ones(2, TOKENS, dtype=torch.long)
    return batch


def _pixels(size: int) -> Callable[[torch.dtype], dict[str, torch.Tensor]]:
    def example(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(2, 3, size, size, generator=g).to(dtype)}
    return example


def _made(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return model.to(dtype).train()


def llama(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return _made(LlamaForCausalLM(LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB)), dtype)


def gemma(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM
    torch.manual_seed(seed)
    model = GemmaForCausalLM(GemmaConfig(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS,
        vocab_size=VOCAB))
    with torch.no_grad():  # Gemma's norms start at zero (a scale of 1): make them differ
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return _made(model, dtype)


def gpt2(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return _made(GPT2LMHeadModel(GPT2Config(
        n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=64)), dtype)


def bert(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    return _made(BertModel(BertConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, vocab_size=VOCAB)), dtype)


def vit(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import ViTConfig, ViTModel
    torch.manual_seed(seed)
    return _made(ViTModel(ViTConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, image_size=32, patch_size=8)), dtype)


def convnext(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import ConvNextConfig, ConvNextModel
    torch.manual_seed(seed)
    return _made(ConvNextModel(ConvNextConfig(
        hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1], image_size=64)), dtype)


def t5_encoder(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import T5Config, T5EncoderModel
    torch.manual_seed(seed)
    return _made(T5EncoderModel(T5Config(
        d_model=HIDDEN, d_ff=2 * HIDDEN, d_kv=HIDDEN // HEADS, num_layers=LAYERS,
        num_heads=HEADS, vocab_size=VOCAB)), dtype)


FAMILIES: dict[str, tuple[Callable[..., nn.Module], Callable[..., dict]]] = {
    "llama": (llama, ids),
    "gpt2": (gpt2, ids),
    "bert": (bert, ids),
    "vit": (vit, _pixels(32)),
    "convnext": (convnext, _pixels(64)),
    "t5_encoder": (t5_encoder, ids),
    "gemma": (gemma, ids),
}


# ------------------------------------------------------------------ the hand swap


def _torch_module(m: nn.Module) -> nn.Module | None:
    """PyTorch's (or timm's ``LayerNorm2d``, the known channels-first class) module computing
    what a Hugging Face norm or activation computes in float32, by class name, holding its
    parameters (Gemma's ``1 + weight`` as a new weight); ``None`` for other modules."""
    name = type(m).__name__
    if name in ("GELUActivation",) and not getattr(m, "use_gelu_python", False):
        return nn.GELU()
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"):
        return nn.GELU(approximate="tanh")
    if name == "SiLUActivation":
        return nn.SiLU()
    if name in ("LlamaRMSNorm", "T5LayerNorm", "GemmaRMSNorm"):
        eps = getattr(m, "variance_epsilon", None) or m.eps
        layer = nn.RMSNorm(m.weight.shape, eps, dtype=m.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(m.weight + 1 if name == "GemmaRMSNorm" else m.weight)
        return layer
    if name == "ConvNextLayerNorm":
        if m.data_format == "channels_last":
            layer = nn.LayerNorm(m.normalized_shape, m.eps, dtype=m.weight.dtype)
        else:
            from timm.layers import LayerNorm2d
            layer = LayerNorm2d(m.normalized_shape[0], m.eps).to(m.weight.dtype)
        layer.weight, layer.bias = m.weight, m.bias
        return layer
    return None


def hand_swapped(model: nn.Module) -> nn.Module:
    """``model`` with its Hugging Face norm and activation modules swapped for PyTorch's,
    in place (by class name, as a user would)."""
    for name, m in list(model.named_modules()):
        swap = _torch_module(m)
        if swap is not None:
            model.set_submodule(name, swap.train(m.training))
    return model
