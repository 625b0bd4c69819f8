"""Muon (Jordan et al., 2024) for the blocks' hidden matrices, AdamW for the rest, as ONE optimizer
(`optimizer=muon`, conf/optimizer/muon.yaml): what Lightning, the LR schedule and checkpoints hold.

Which parameters are Muon's comes from the model contract (models/contract.py), not from a family's names: the
2-D parameters inside `model.layers` (the blocks' projections); the input and output ends (embeddings, the head)
and every vector (norm weights) are AdamW's, as Moonlight, modded-nanogpt and torchtitan group them.
`mark_hidden_matrices` splits the module's parameter groups (`CausalLM.param_groups`) by that rule, each group
keeping its own keys (the norms' weight_decay=0.0 stays with AdamW) and saying `muon: true` or `false`.

The Muon update is torch's (`torch.optim.Muon`: momentum, Nesterov, the Newton-Schulz orthogonalization in bf16,
`adjust_lr_fn`), step for step, with two changes of how, not what. The orthogonalization runs in batches of
same-shape matrices, one compiled function on CUDA (newton_schulz.py), each matrix normalized on its own as in
torch's; by default (`ns_method: gram`) the same iteration runs on the Gram matrix, a third fewer FLOPs on Llama's
MLP, k and v matrices, equal to torch's in exact arithmetic (`ns_method: standard` is torch's, op for op). And
each rank orthogonalizes only its share of the matrices, whole, and gets back its piece of every result
(muon_share.py): a sharded parameter (a DTensor under fsdp or model_parallel, on any mesh) shares with the
ranks of its mesh; whole ones under ddp with the ranks of torch.distributed's default group, whose gradients are
equal after the all-reduce. Where ranks hold different whole matrices, each orthogonalizes its own: ddp_sharded's
ZeroRedundancyOptimizer builds one MuonAdamW per rank over that rank's parameters (ZeRO splits the work), and
model_parallel's pipeline stages are DTensors on their own stage's data-parallel mesh (size 1 without one). The
AdamW side is torch's AdamW (`fused` on CUDA through `adamw_fused`), stepped over the same state.

Not torch.optim.Muon itself: it takes only matrices, so it could not be the one optimizer Lightning steps
(test_library_gaps.py::test_torchs_muon_takes_only_matrices_so_it_cannot_be_the_one_optimizer).

The state is one torch optimizer state: `state_dict`/`load_state_dict`/`zero_grad` are `torch.optim.Optimizer`'s,
so Lightning checkpoints, torch's distributed state dicts (fsdp, model_parallel) and the universal resume
(optimizer state keyed by parameter name) take it as they take AdamW's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from parallama.errors import ConfigError
from parallama.training.muon_share import Piece, orthogonalized
from parallama.training.newton_schulz import NS_METHODS

MUON = "muon"  # the group key saying whose the group is
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ADJUST_LR = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The matrices inside the model contract's blocks (`model.layers`): Muon's parameters."""
    return [p for p in model.layers.parameters() if p.requires_grad and p.ndim == 2]


def mark_hidden_matrices(groups: list[dict], model: torch.nn.Module) -> list[dict]:
    """`groups` with each split in two: its hidden matrices (`muon: true`) and the rest (`muon: false`), both
    with the group's other keys; empty halves are dropped."""
    hidden = {id(p) for p in hidden_matrices(model)}
    out = []
    for group in groups:
        params = list(group["params"])
        for muon in (True, False):
            part = [p for p in params if (id(p) in hidden) == muon]
            if part:
                out.append({**group, "params": part, MUON: muon})
    return out


def adjusted_lr(lr: float, adjust: str | None, shape) -> float:
    """torch.optim.Muon's `adjust_lr_fn` on the parameter's whole shape: "original" (the default) sqrt(max(1,
    A/B)), "match_rms_adamw" 0.2 sqrt(max(A, B)) (Moonlight: the update's RMS of AdamW's, so one lr serves both)."""
    rows, cols = shape[:2]
    if adjust is None or adjust == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon: true`, AdamW on the others (`mark_hidden_matrices`), in one optimizer.

    lr, momentum, nesterov, ns_steps, weight_decay, adjust_lr: Muon's (torch's `adjust_lr_fn`: "original",
    "match_rms_adamw" or null); ns_dtype: the Newton-Schulz iteration's, bfloat16 (torch's) or float32;
    ns_method: "gram" (the iteration on the Gram matrix: newton_schulz.py) or "standard" (torch's, op for op).
    adamw_lr (null: lr), adamw_betas, adamw_eps, adamw_weight_decay: AdamW's; adamw_fused: torch's `fused` for
    AdamW (null: torch's default; parallama-train resolves it as optimizer.fused, training/optim.py
    `with_fused_default`). A group's own keys (the norms' weight_decay=0.0) win over these.
    share_replicas: whole matrices are the same on every rank of torch.distributed's default group (ddp, after
    its all-reduce), so each rank orthogonalizes a share of them (muon_share.py); sharded ones (DTensors) are
    always shared over their mesh."""

    takes_hidden_matrices = True  # CausalLM.configure_optimizers marks its groups with mark_hidden_matrices
    fused_keyword = "adamw_fused"  # training/optim.py `with_fused_default`

    def __init__(
        self,
        params,
        lr: float = 3e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.1,
        adjust_lr: str | None = "match_rms_adamw",
        ns_dtype: str = "bfloat16",
        ns_method: str = "gram",
        adamw_lr: float | None = None,
        adamw_betas=(0.9, 0.99),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.1,
        adamw_fused: bool | None = None,
        share_replicas: bool = True,
    ) -> None:
        groups = list(params)
        if not all(isinstance(g, dict) and MUON in g for g in groups):
            raise ValueError(
                "MuonAdamW takes parameter groups marked muon=true/false "
                "(parallama.training.muon.mark_hidden_matrices)"
            )
        self.check_keywords(
            dict(
                lr=lr,
                momentum=momentum,
                ns_steps=ns_steps,
                ns_dtype=ns_dtype,
                ns_method=ns_method,
                adjust_lr=adjust_lr,
                adamw_lr=adamw_lr,
                adamw_betas=adamw_betas,
                adamw_fused=adamw_fused,
            )
        )
        muon = [g for g in groups if g[MUON]]
        adamw = [g for g in groups if not g[MUON]]
        # torch's own optimizers check the keys and fill each group's defaults (in place: the same dicts); the
        # Muon step is this class's (batched, shared across ranks), the AdamW step torch's
        if muon:
            torch.optim.Muon(
                muon,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr,
            )
        self._adamw = (
            torch.optim.AdamW(
                adamw,
                lr=lr if adamw_lr is None else adamw_lr,
                betas=tuple(adamw_betas),
                eps=adamw_eps,
                weight_decay=adamw_weight_decay,
                fused=adamw_fused,
            )
            if adamw
            else None
        )
        super().__init__(muon + adamw, {})
        self._share_replicas, self._replicas = share_replicas, None
        # How the iteration computes, not optimizer state: kept out of the parameter groups, so that a resumed run
        # computes as configured under every strategy (torch's load_state_dict, and ZeRO's group sync, would
        # otherwise bring back the checkpoint's).
        self._ns_method, self._ns_dtype = ns_method, NS_DTYPES[ns_dtype]
        # What ZeroRedundancyOptimizer (ddp_sharded) builds one optimizer per rank with, over that rank's own
        # parameters: its matrices are not its peers', so it orthogonalizes them itself (ZeRO splits the work).
        self.defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            adjust_lr=adjust_lr,
            ns_dtype=ns_dtype,
            ns_method=ns_method,
            adamw_lr=adamw_lr,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
            adamw_fused=adamw_fused,
            share_replicas=False,
        )

    @staticmethod
    def check_keywords(keywords: dict) -> None:
        """The configured keys (training/optim.py `check_optimizer`, before any work): one line naming a bad one."""
        rules = {
            "lr": (lambda v: _number(v) and v >= 0, "a number >= 0"),
            "adamw_lr": (lambda v: v is None or (_number(v) and v >= 0), "null or a number >= 0"),
            "momentum": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
            "ns_steps": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v < 100, "1 to 99"),
            "ns_dtype": (lambda v: v in NS_DTYPES, "bfloat16 or float32"),
            "ns_method": (lambda v: v in NS_METHODS, "standard or gram"),
            "adjust_lr": (lambda v: v in (None, *ADJUST_LR), "match_rms_adamw, original or null"),
            "adamw_betas": (
                lambda v: len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
                "two numbers in [0, 1), e.g. [0.9, 0.95]",
            ),
            "adamw_fused": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
        }
        for key, (valid, text) in rules.items():
            if key in keywords and not valid(keywords[key]):
                value = keywords[key]
                shown = list(value) if isinstance(value, tuple) else value
                raise ConfigError(f"optimizer.{key}={shown} is not valid; use {text}")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, refusing in one line the state of another optimizer (a resume that switched to Muon)."""
        groups = state_dict["param_groups"]
        mine = [g[MUON] for g in self.param_groups]
        if [g.get(MUON) for g in groups] != mine:
            raise ConfigError(
                "the checkpoint's optimizer state is not optimizer=muon's with these parameter groups; resume it "
                "with the optimizer it was trained with"
            )
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning runs the training step in it
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group[MUON]:
                self._muon_step(group)
        adamw = [g for g in self.param_groups if not g[MUON]]
        if adamw:
            # torch's AdamW over this optimizer's groups and state (load_state_dict replaces both)
            self._adamw.param_groups, self._adamw.state = adamw, self.state
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        """torch.optim.Muon's `_single_tensor_muon` on each rank's pieces, the orthogonalization batched and
        shared (muon_share.py). Every rank holding a matrix skips it alike when it has no gradient."""
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        lr = lr.item() if isinstance(lr, Tensor) else lr
        params, pieces = [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            grad, buf = _local(param.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            params.append(param)
            pieces.append(self._piece(update, param))
        results = orthogonalized(
            pieces,
            group["ns_coefficients"],
            group["ns_steps"],
            group["eps"],
            self._ns_dtype,
            self._ns_method,
        )
        for param, result in zip(params, results):
            local = _local(param)
            local.mul_(1 - lr * weight_decay)
            local.add_(result, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))

    def _piece(self, update: Tensor, param) -> Piece:
        """`update` (this rank's piece of it) with the ranks that hold its matrix."""

        if isinstance(param, DTensor):
            grad = param.grad
            return Piece(update, grad.device_mesh, grad.placements, param.placements, param.shape)
        return Piece(update, self._replica_mesh(update.device), (Replicate(),), (Replicate(),), param.shape)

    def _replica_mesh(self, device: torch.device):
        """torch.distributed's default group as a mesh, where whole matrices are replicas on its ranks (ddp)."""

        if not (self._share_replicas and dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_world_size() == 1:
            return None
        if self._replicas is None:
            self._replicas = DeviceMesh.from_group(dist.group.WORLD, device.type)
        return self._replicas


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (a view: in-place ops change the DTensor), or the tensor itself."""

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
