"""The Llama's tensor-parallel plan and ModelParallel's helpers in one process (a 1-rank gloo mesh): the
DTensor code paths without launching ranks. Several ranks: tests/distributed/test_model_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from parallama.distributed.dims import ParallelDims
from parallama.distributed.options import FSDPOptions, ParallelizeOptions
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.models.llama.parallelize import parallelize
from parallama.parallel.strategies.model_parallel import FullLogits, clip_grad_norm_, full_copy

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def sharded(mesh, *, sequence_parallel: bool, tie: bool = False):
    """A plain model and its copy under TP (on the 1-rank tp dimension) and FSDP, as ModelParallel asks."""
    from parallama.models.llama.parallelize import apply_tp

    torch.manual_seed(0)
    plain = Llama(LlamaConfig(**CONFIG, tie_word_embeddings=tie))
    model = Llama(LlamaConfig(**CONFIG, tie_word_embeddings=tie))
    model.load_state_dict(plain.state_dict())
    apply_tp(model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=True)
    options = ParallelizeOptions(dims=ParallelDims(), mesh=mesh, fsdp=FSDPOptions())
    parallelize(model, options)  # tp=1 in dims: only FSDP here
    return plain, model


def batch():
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_loss_and_clipping_over_several_meshes_match_the_plain_model(
    one_rank_mesh, sequence_parallel
):
    from torch.distributed.tensor.parallel import loss_parallel

    plain, model = sharded(one_rank_mesh, sequence_parallel=sequence_parallel)
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    if not sequence_parallel:  # norms: FSDP's 1-D DTensors; TP weights: 2-D (dp_shard, tp)
        assert meshes == {("dp_shard",), ("dp_shard", "tp")}
    x, y = batch()
    want = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
    want.backward()
    want_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    with loss_parallel():
        logits = model(x)
        assert isinstance(logits, DTensor) and logits.placements[-1].is_shard(logits.ndim - 1)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
    got_norm = clip_grad_norm_(list(model.parameters()), 0.1)
    torch.testing.assert_close(loss.full_tensor(), want)
    torch.testing.assert_close(got_norm, want_norm)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_inference_sees_full_logits_and_a_full_copy_generates_alike(one_rank_mesh):
    plain, model = sharded(one_rank_mesh, sequence_parallel=False, tie=True)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied embeddings stay one parameter
    x, _ = batch()
    with torch.no_grad():
        logits = FullLogits(model)(x)
        assert not isinstance(logits, DTensor)
        torch.testing.assert_close(logits, plain(x))
        copy = full_copy(model, Llama, torch.device("cpu"))
        assert not any(isinstance(p, DTensor) for p in copy.parameters())
        torch.testing.assert_close(copy(x), plain(x))
