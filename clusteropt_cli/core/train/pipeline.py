"""Pipeline parallelism with torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B).

The HF decoder is cut into `stages × virtual_stages` contiguous chunks of layers (the first chunk also holds the
embeddings, the last one the final norm and the LM head); rank r runs chunks r, r + P, r + 2P, ... Each step
takes micro_batch × grad_accum sequences, split into `pipeline_micro_batches` micro-batches; the schedule scales
gradients by 1/micro-batches, so the loss and the update equal those of one process on the same batch.
Tied embeddings on different ranks get their gradient summed across ranks (as Megatron does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clusteropt_cli.core.train.checkpoint import load_torch_file, save_torch_file
from clusteropt_cli.core.train.distributed import DistContext
from clusteropt_cli.core.train.engines import build_optimizer, lr_lambda
from clusteropt_cli.core.train.precision import autocast_context
from clusteropt_cli.errors import BadInputError


def split_layers(num_layers: int, num_chunks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, as even as possible (earlier chunks get the remainder)."""
    if num_chunks > num_layers:
        raise BadInputError(f"{num_chunks} pipeline stages (stages × virtual stages) exceed the model's "
                            f"{num_layers} layers.", hint="lower --pipeline-stages or --virtual-stages")
    base, extra = divmod(num_layers, num_chunks)
    bounds, start = [], 0
    for i in range(num_chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def make_stage_module(model: Any, layer_range: tuple[int, int], first: bool, last: bool, precision: str,
                      device_type: str) -> Any:
    """An nn.Module running one chunk of an HF decoder (Llama-style: embed_tokens, layers, norm, rotary_emb)."""
    import torch
    from transformers.masking_utils import create_causal_mask

    decoder = model.get_decoder()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            raise BadInputError(f"Pipeline parallelism needs a Llama-style decoder; {type(model).__name__} has no "
                                f"'{name}'.", hint="train this model with --zero or --gpus (data parallel)")

    class DecoderStage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = decoder.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(decoder.layers[layer_range[0] : layer_range[1]])
            self.norm = decoder.norm if last else None
            self.lm_head = model.get_output_embeddings() if last else None
            self.rotary_emb = decoder.rotary_emb
            self.config = model.config

        def forward(self, x: Any) -> Any:
            with autocast_context(precision, device_type):
                hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
                positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
                position_embeddings = self.rotary_emb(hidden, position_ids=positions)
                mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                          past_key_values=None, position_ids=positions)
                for layer in self.layers:
                    hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                                   position_ids=positions)
                if self.lm_head is not None:
                    hidden = self.lm_head(self.norm(hidden))
            return hidden

    return DecoderStage()


def pipeline_loss(logits: Any, labels: Any) -> Any:
    """Mean next-token cross-entropy of one micro-batch (fp32)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


class PipelineEngine:
    """Runs one optimizer step per `train_step(batch)` through a torch pipelining schedule."""

    def __init__(self, options: Any, model: Any, ctx: DistContext, total_steps: int):
        import torch
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self.options, self.ctx, self.full_model = options, ctx, model
        stages = int(options.pipeline_stages)
        virtual = int(options.virtual_stages) if options.pipeline_schedule == "interleaved-1f1b" else 1
        chunks = stages * virtual
        bounds = split_layers(model.config.num_hidden_layers, chunks)
        self.stage_indices = [ctx.rank + k * stages for k in range(virtual)]
        self.stage_modules = [make_stage_module(model, bounds[i], i == 0, i == chunks - 1, options.precision,
                                                ctx.device_type) for i in self.stage_indices]
        self.has_first = 0 in self.stage_indices
        self.has_last = chunks - 1 in self.stage_indices
        self.last_rank = (chunks - 1) % stages
        batch = int(options.micro_batch) * int(options.grad_accum)
        n_micro = int(options.pipeline_micro_batches or batch)
        if batch % n_micro:
            raise BadInputError(f"micro_batch × grad_accum = {batch} does not split into {n_micro} micro-batches.",
                                hint="set --pipeline-micro-batches to a divisor of micro_batch × grad_accum")
        if options.pipeline_schedule != "gpipe" and n_micro < stages:
            raise BadInputError(f"{options.pipeline_schedule} needs at least {stages} micro-batches (one per stage); "
                                f"this step has {n_micro}.", hint="raise --micro-batch/--grad-accum or "
                                "--pipeline-micro-batches")
        self.n_micro = n_micro
        pipe_stages = [PipelineStage(m, i, chunks, ctx.device) for m, i in zip(self.stage_modules, self.stage_indices,
                                                                                strict=True)]
        if options.pipeline_schedule == "gpipe":
            self.schedule = ScheduleGPipe(pipe_stages[0], n_microbatches=n_micro, loss_fn=pipeline_loss)
        elif options.pipeline_schedule == "1f1b":
            self.schedule = Schedule1F1B(pipe_stages[0], n_microbatches=n_micro, loss_fn=pipeline_loss)
        else:
            self.schedule = ScheduleInterleaved1F1B(pipe_stages, n_microbatches=n_micro, loss_fn=pipeline_loss)
        self.name = f"pipeline-{options.pipeline_schedule}x{stages}" + (f"v{virtual}" if virtual > 1 else "")

        owned: dict[int, Any] = {}
        for module in self.stage_modules:
            for p in module.parameters():
                owned[id(p)] = p
        self.params = list(owned.values())
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.owned_names = sorted({names[id(p)] for p in self.params if id(p) in names})
        self.model = torch.nn.ModuleList(self.stage_modules)  # what this rank holds (memory accounting)
        self.tied = None
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings()
        if head is not None and head.weight is embed.weight and stages > 1:
            self.tied = embed.weight  # lives on the first and the last stage's ranks
        groups = [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": options.weight_decay},
                  {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = build_optimizer(options, [g for g in groups if g["params"]], ctx.device_type)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(options, total_steps))

    def train_step(self, batch: dict[str, Any]) -> Any:
        """Forward + backward of one global batch through the schedule; returns the mean loss on every rank."""
        import torch
        import torch.distributed as dist

        inputs = batch["input_ids"].to(self.ctx.device)
        labels = batch["labels"].to(self.ctx.device)
        losses: list[Any] = []
        args = (inputs,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=labels, losses=losses)
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            self.schedule.step(*args)
            loss = torch.zeros((), device=self.ctx.device)
        dist.broadcast(loss, src=self.last_rank)
        return loss

    def optimizer_step(self) -> float | None:
        import torch
        import torch.distributed as dist

        if self.tied is not None:  # sum the embedding's and the head's gradient of a tied weight
            grad = self.tied.grad if self.tied.grad is not None else torch.zeros_like(self.tied)
            if self.tied.grad is None and any(p is self.tied for p in self.params):
                self.tied.grad = grad
            dist.all_reduce(grad)  # every rank joins; ranks without the weight add zeros
        local = torch.zeros((), device=self.ctx.device, dtype=torch.float32)
        for p in self.params:
            if p.grad is not None and not (p is self.tied and not self.has_first):
                local += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(local)
        norm = float(local.sqrt())
        if self.options.grad_clip and norm > self.options.grad_clip:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.options.grad_clip / (norm + 1e-6))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    loss_scale = None

    def _owned_state(self) -> dict[str, Any]:
        full = self.full_model.state_dict()
        return {name: full[name].detach().cpu() for name in self.owned_names}

    def save(self, directory: Path) -> None:
        state = {"model": self._owned_state(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict()}
        save_torch_file(state, Path(directory) / f"pipeline_rank{self.ctx.rank}.pt")

    def load(self, directory: Path) -> None:
        state = load_torch_file(Path(directory) / f"pipeline_rank{self.ctx.rank}.pt")
        self.full_model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def final_state_dict(self) -> dict[str, Any] | None:
        """Collective: rank 0 gets the full weights assembled from every stage."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, self._owned_state())
        if not self.ctx.is_main:
            return None
        state = {k: v.detach().cpu() for k, v in self.full_model.state_dict().items()}
        for part in gathered:
            state.update(part)
        return state
