"""Converted models under the engines that wrap them afterwards (docs/design.md, "The
in-place contract"): FSDP2 (``fully_shard`` per block and on the root) and DDP with two gloo
processes on CPU, ``torch.utils.checkpoint`` (reentrant and not) per block, and Hugging Face's
``gradient_checkpointing_enable``. Each step's gradients equal the model as given (float64).

These engines hand the layers tensors autograd does not let be overwritten (FSDP2's hooks pass
each block's input through a custom Function; a reentrant checkpoint recomputes on detached
leaves) or that they read again (a checkpoint recomputes from its inputs); the run-time rule
computes those output-only."""

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

import engine_models as em
import engine_workers

pytest.importorskip("timm", reason="timm is not installed")



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(cases) -> None:
    mp.spawn(engine_workers.run, args=(2, _free_port(), cases), nprocs=2, join=True)


# two spawned gloo ranks (11 s on the quiet 2 cores): the slow run, with the other multi-rank
# cases; the checkpointing cases below run by default
@pytest.mark.slow
def test_fsdp2_and_ddp_give_the_model_s_gradients():
    """A ConvNeXt of torch modules, whose stages start with the norm FSDP2's hook view reaches
    first (the ranks' start is most of this test's cost)."""
    _spawn((("convnext_like", "fsdp2"), ("convnext_like", "ddp")))


@pytest.mark.slow
def test_fsdp2_and_ddp_give_timm_s_models_gradients():
    _spawn(tuple((model, engine) for model in ("convnext", "vit")
                 for engine in ("fsdp2", "ddp")))


def _checkpointed(model, reentrant: bool):
    for block in em.blocks(model):
        block.forward = (lambda forward: lambda *args: checkpoint(
            forward, *args, use_reentrant=reentrant))(block.forward)
    return model


# timm's ViT non-reentrant (2.5 s) in the slow run: convnext_like has both checkpoints by default
@pytest.mark.parametrize(("build", "reentrant"), [
    (em.convnext_like, True), (em.convnext_like, False),
    pytest.param(em.convnext, True, marks=pytest.mark.slow),
    pytest.param(em.convnext, False, marks=pytest.mark.slow),
    (em.vit, True), pytest.param(em.vit, False, marks=pytest.mark.slow)],
    ids=["convnext_like-reentrant", "convnext_like-non-reentrant", "timm_convnext-reentrant",
         "timm_convnext-non-reentrant", "timm_vit-reentrant", "timm_vit-non-reentrant"])
def test_checkpointed_blocks_give_the_model_s_gradients(build, reentrant):
    model = build()
    x = em.images(model)
    want = em.reference_gradients(model, [x])
    wrapped = _checkpointed(em.converted(model, x), reentrant)
    before = x.clone()
    em.loss(wrapped(x)).backward()
    assert torch.equal(x, before)
    assert em.largest_difference(em.gradients(wrapped), want) <= em.TOLERANCE


def _bert():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertModel(config).double().train()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing_enable's rename
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_hugging_face_gradient_checkpointing_gives_the_model_s_gradients(reentrant):
    """BERT, whose norms are nn.LayerNorm, converted, then checkpointed by its own switch."""
    model = _bert()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))

    def step(m):
        m.zero_grad()
        em.loss(m(ids).last_hidden_state).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    want = step(model)
    converted = copy.deepcopy(em.converted(model, (ids,)))
    converted.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert em.largest_difference(step(converted), want) <= em.TOLERANCE
