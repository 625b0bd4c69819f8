"""A parallama model as an lm-evaluation-harness model, registered as `parallama` (once this module is imported,
`lm_eval.simple_evaluate(model="parallama", model_args="ckpt_path=...")` builds it).

It reuses lm-eval's own request encoding (`TemplateLM`: context/continuation split, the prefix token of an empty
context, rolling windows), so its scores are those of lm-eval's `hf` model on the exported folder, and adds
what only parallama knows: reading any checkpoint (`checkpoint.read`) or exported folder, the tokenizer stored in
it, and running on a model that a strategy has sharded.

Batches are right-padded (the attention is causal, so padding after a sequence changes none of its logits) and
sorted by length. Under a process group the ranks split the requests (lm-eval hands each its share, `rank` and
`world_size` are the data-parallel ones) and every rank runs the same number of forward passes (a rank with fewer
batches, or a generation that ends sooner, runs one-token dummy passes for the ones it lacks), since a sharded
model (FSDP, ZeRO-3) gathers its parameters collectively in each forward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import lm_eval.models  # noqa: F401  lm-eval lists its own models (hf, vllm, ...) only while its registry is empty
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tokenizers import Tokenizer

from parallama.errors import ConfigError
from parallama.models.generation import generate
from parallama.tokenizer import special_ids


@register_model("parallama")
class ParallamaLM(TemplateLM):
    """`model`: a plain parallama model (or the strategy's `inference_model`), or None to load `ckpt_path` (any
    strategy's checkpoint) or `model_dir` (an exported Hugging Face folder). `dp_ranks`: the data-parallel rank
    of every global rank, when the model runs under a process group (None: one process)."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        *,
        ckpt_path: str | None = None,
        model_dir: str | None = None,
        batch_size: int = 16,
        max_gen_toks: int = 256,
        add_bos_token: bool = True,
        device: str | torch.device | None = None,
        dp_ranks: list[int] | None = None,
        forward_context: Callable | None = None,
    ) -> None:
        super().__init__()
        if model is None:
            from parallama.checkpoint.read import load_model  # start-up time (hydra)

            model, tokenizer = load_model(ckpt_path, model_dir)
            model.to(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))).eval()
        # where the inputs go: `device`, else the parameters' (which FSDP2's cpu_offload keeps on the CPU)
        self._device = torch.device(device) if device else next(model.parameters()).device
        self.model, self.tokenizer = model, tokenizer
        self.ids = special_ids(tokenizer)
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.max_length = model.config.max_position_embeddings
        self.dp_ranks = dp_ranks
        self.forward_context = forward_context
        if dp_ranks is not None:
            self._rank, self._world_size = dp_ranks[dist.get_rank()], max(dp_ranks) + 1

    # --- what lm-eval asks of a model -----------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.ids.eot

    @property
    def prefix_token_id(self) -> int:
        """Before an empty context and the first rolling window: every training document starts with it."""
        return self.ids.bot

    @property
    def tokenizer_name(self) -> str:
        return "parallama"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=False).ids
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return [self.ids.bot, *ids] if bos else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)  # no bar in a training log

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation, whether it is the greedy one), for each
        ((context, continuation), context_ids, continuation_ids)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if too_long := [r[2] for r in requests if len(r[2]) > self.max_length]:
            raise ConfigError(
                f"a continuation of {len(too_long[0])} tokens does not fit the model's context of {self.max_length}"
            )
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for batch in self._lockstep(batches):
            if not batch:
                self._forward(torch.tensor([[self.ids.bot]], device=self.device))  # the others' pass
                continue
            seqs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1) :][:-1] for i in batch]
            width = max(map(len, seqs))
            inputs = torch.full((len(seqs), width), self.ids.pad, dtype=torch.long)
            for row, seq in enumerate(seqs):
                inputs[row, : len(seq)] = torch.tensor(seq)
            logprobs = F.log_softmax(self._forward(inputs.to(self.device)).float(), dim=-1).cpu()
            for row, (i, seq) in enumerate(zip(batch, seqs)):
                cont = torch.tensor(requests[i][2])
                lp = logprobs[row, len(seq) - len(cont) : len(seq)]
                greedy = bool((lp.argmax(-1) == cont).all())
                results[i] = (float(lp.gather(-1, cont[:, None]).sum()), greedy)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in windows of the model's context that each predict new tokens only
        (lm-eval's own windows: the first starts with the prefix token)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, `do_sample`/`temperature`) continuations cut at the first `until` string, with the
        KV cache. Batches hold prompts of one length (no padding) and one set of generation settings."""

        groups = defaultdict(list)
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kw = dict(gen_kwargs)
            until = kw.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
            max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            groups[(len(ids), max_new, temperature)].append((i, ids, until))
        batches = [
            (key, items[j : j + self.batch_size])
            for key, items in sorted(groups.items())
            for j in range(0, len(items), self.batch_size)
        ]
        out: list[str | None] = [None] * len(requests)
        sharded = self.dp_ranks is not None
        for step in self._lockstep(batches):
            (length, max_new, temperature), items = step or ((0, 0, 0.0), [])
            forwards = (
                max(max_new, 1) if items else 0
            )  # the prompt's pass makes the first token, one each after
            missing = (
                self._agree(forwards) - forwards
            )  # agreed first: each pass pairs with one of every other rank
            if items:
                with self._context():
                    tokens = generate(
                        self.model,
                        torch.tensor([ids for _, ids, _ in items], device=self.device),
                        max_new_tokens=max_new,
                        temperature=temperature,
                        eos_id=None
                        if sharded
                        else self.ids.eot,  # a stop no other rank knows of would hang them
                        generator=torch.Generator(device=self.device).manual_seed(1234),
                    )
                self._decode(items, tokens[:, length:].tolist(), out)
            for _ in range(missing):  # the passes of ranks that generate longer; no grad, as `generate`'s
                with torch.no_grad():
                    self._forward(torch.tensor([[self.ids.bot]], device=self.device))
        return out

    def _decode(self, items: list, rows: list[list[int]], out: list) -> None:
        """Each generated row as text, cut at the end-of-text token and the first of its `until` strings."""
        for (i, _, until), row in zip(items, rows):
            if self.ids.eot in row:
                row = row[: row.index(self.ids.eot)]
            text = self.tok_decode(row)
            for stop in until:
                text = text.split(stop)[0]
            out[i] = text

    # --- ranks --------------------------------------------------------------------------------------------

    def _lockstep(self, batches: list) -> list:
        """`batches`, padded with empty ones to the longest rank's count (one process: as they are)."""
        return batches + [None] * (self._agree(len(batches)) - len(batches))

    def _agree(self, n: int) -> int:
        """The largest `n` of all ranks."""
        if self.dp_ranks is None:
            return n
        t = torch.tensor([n], device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _gather(self, obj) -> list:
        """One `obj` per data-parallel rank, in rank order (ranks that share one, e.g. tensor-parallel peers,
        hold the same)."""
        objs = [None] * dist.get_world_size()
        dist.all_gather_object(objs, obj)
        first = {}
        for rank, dp in enumerate(self.dp_ranks):
            first.setdefault(dp, objs[rank])
        return [first[dp] for dp in sorted(first)]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dp_ranks is None:
            return tensor[None]
        return torch.stack([t.to(tensor.device) for t in self._gather(tensor.cpu())])

    def gather_object(self, obj, dst: int = 0) -> list:
        return [obj] if self.dp_ranks is None else self._gather(obj)

    def barrier(self) -> None:
        if self.dp_ranks is not None:
            dist.barrier()

    # --- the model ----------------------------------------------------------------------------------------

    def _context(self):
        return (
            self.forward_context()
            if self.forward_context is not None
            else torch.autocast("cpu", enabled=False)
        )

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self._context():
            return self.model(input_ids)
