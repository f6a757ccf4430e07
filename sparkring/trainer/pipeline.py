"""Pipeline parallelism's mechanics for fit(): the model cut into stages at module boundaries, this
rank's stage(s) of its pipeline, torch's schedules (GPipe, 1F1B, interleaved 1F1B) driving the
microbatches, and the step the loop runs through them (PipelineStep).

An ``nn.Sequential`` model is cut between its top-level children, which stay the modules they were
(so tensor parallelism and fsdpWrap's class names apply to a stage); a Hugging Face Llama between
decoder layers (trainer.decoder_stages, whose stages hold its own modules too); any other model is
cut by torch's tracer (``torch.distributed.pipelining.pipeline``), whose stages hold InterpreterModules.
Either way a stage's parameters keep the model's names, and ``with_original_names`` gathers this
rank's stages into one module under those names, through which the optimizer, the checkpoints
(DCP: any layout resumes any other) and the fitted weights written at the end see them."""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from typing_extensions import override

from . import decoder_stages, losses, saving
from .activation import named_blocks
from .config import ModelParallel
from .figures import Totals
from .step import Outcome, PlainStep, Step

SEQUENTIAL_HINT = ("pipelineSplit names top-level children of an nn.Sequential model (its indices, e.g. '4'), or "
                   "any module of another model (e.g. 'layers.2')")


def balanced_split(model: torch.nn.Module, stages: int, wrap: Tuple[str, ...] = ()) -> List[str]:
    """Where stages 1.. begin when pipelineSplit is unset: block boundaries that balance the
    parameters (an ``nn.Sequential``'s top-level children, else activation.named_blocks).

    >>> balanced_split(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]), 2)
    ['2']
    """
    if isinstance(model, torch.nn.Sequential):
        blocks = [(name, m) for name, m in model.named_children() if any(True for _ in m.parameters())]
    else:
        blocks = named_blocks(model, wrap)
    if len(blocks) < stages:
        raise ValueError(f"pipelineParallel: the model has {len(blocks)} block(s) that hold parameters, fewer than "
                         f"its {stages} stages; lower pipelineParallel or name the cuts in pipelineSplit")
    sizes = [sum(p.numel() for p in m.parameters()) for _, m in blocks]
    total, seen = sum(sizes), 0
    cuts: List[str] = []
    for i, size in enumerate(sizes[:-1]):
        seen += size
        remaining_blocks, remaining_cuts = len(sizes) - i - 1, stages - 1 - len(cuts)
        if remaining_cuts and (seen >= total * (len(cuts) + 1) / stages or remaining_blocks == remaining_cuts):
            cuts.append(blocks[i + 1][0])
    return cuts


def keeps_modules(model: torch.nn.Module) -> bool:
    """Whether ``cut`` gives stages of the model's own modules (an ``nn.Sequential``, a Hugging Face
    decoder), which may be cut on the meta device, rather than the tracer's copies."""
    return isinstance(model, torch.nn.Sequential) or decoder_stages.cuts(model)


def cut(model: torch.nn.Module, split: List[str], example: Callable[[], tuple]) -> List[torch.nn.Module]:
    """Every stage's module, in order (each rank keeps its own and drops the rest)."""
    if decoder_stages.cuts(model):
        return decoder_stages.cut(model, split, len(split) + 1)
    if isinstance(model, torch.nn.Sequential):
        names = [name for name, _ in model.named_children()]
        unknown = [s for s in split if s not in names]
        if unknown:
            raise ValueError(f"pipelineSplit: {unknown} are not top-level children of the nn.Sequential model "
                             f"({', '.join(names)}); {SEQUENTIAL_HINT}")
        bounds = [0] + sorted(names.index(s) for s in split) + [len(names)]
        children = dict(model.named_children())
        return [torch.nn.Sequential(collections.OrderedDict((n, children[n]) for n in names[a:b]))
                for a, b in zip(bounds, bounds[1:])]
    from torch.distributed.pipelining import SplitPoint, pipeline

    pipe = pipeline(model, mb_args=example(), split_spec={name: SplitPoint.BEGINNING for name in split})
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def stage_indices(pp_rank: int, parallel: ModelParallel) -> List[int]:
    """The stages this rank of the pipeline holds: its own, or with interleaving every pp-th.

    >>> stage_indices(1, ModelParallel(pipeline_parallel=2, schedule="interleaved-1f1b"))
    [1, 3]
    """
    return [pp_rank + k * parallel.pipeline_parallel for k in range(parallel.stages_per_rank)]


def with_original_names(parts: List[torch.nn.Module]) -> torch.nn.Module:
    """One module holding the parameters of ``parts`` (this rank's stages) under the model's own
    names: the modules that hold them are placed at their paths (shared, not copied), so what the
    optimizer steps and a checkpoint saves are the stages' parameters, named as in the whole model."""
    root = torch.nn.Module()
    for part in parts:
        for path, module in part.named_modules():
            own = (any(True for _ in module.parameters(recurse=False))
                   or any(True for _ in module.buffers(recurse=False)))
            if path and own:
                decoder_stages.place(root, path, module)
    return root


def schedule_for(stages: List[Any], parallel: ModelParallel, loss_fn: Callable) -> Any:
    """torch's schedule for ``stages`` (this rank's), microbatch losses averaged (scale_grads)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    n = parallel.microbatch_count
    if parallel.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n, loss_fn=loss_fn)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[parallel.schedule]
    return single(stages[0], n_microbatches=n, loss_fn=loss_fn)


class PipelineStep(Step):
    """A batch through this rank's stages: the first stage feeds the inputs, the last computes each
    microbatch's loss (and runs backward as the schedule goes), and every stage of the pipeline gets
    the last stage's figures (one broadcast a step), so a non-finite loss stops them at the same step.

    >>> plain = PlainStep(cfg, device, 0)  # doctest: +SKIP
    >>> step = PipelineStep(plain, schedule, first=True, last=False, pp=(group, 1))  # doctest: +SKIP
    """

    def __init__(self, plain: PlainStep, schedule: Any, first: bool, last: bool, pp: Tuple[Any, int]):
        self.plain, self.schedule, self.first, self.last = plain, schedule, first, last
        self.group, self.last_rank = pp  # the pipeline's process group; the global rank of its last stage
        self.device = plain.device
        self.output_shapes: Optional[List[List[int]]] = None
        self.figures_now: Optional[torch.Tensor] = None
        self.tokens_per_microbatch: Optional[torch.Tensor] = None  # a token loss's mean count (this batch)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The first head's loss of a microbatch's output (what the schedule backpropagates). A token
        loss is weighed by the microbatch's share of the batch's real tokens, so that the schedule's
        mean over microbatches is the batch's mean over its tokens, as one forward of the batch gives."""
        loss = self.plain.cfg.losses[0]
        value = losses.compute_loss(loss, out, losses.prepare_label(y, out, loss, True), None)
        if self.tokens_per_microbatch is not None:
            value = value * losses.counted_tokens(loss, y) / self.tokens_per_microbatch
        return value

    @override
    def __call__(self, model: Any, batch: Dict[str, Any], where: str, /) -> Outcome:
        cfg = self.plain.cfg
        args, keywords = cfg.spec.model_args(batch)
        if keywords and not args:  # token columns: the ids enter the first stage, the rest reach every stage
            first_input = next(iter(keywords))
            args = (keywords.pop(first_input),)
        inputs = tuple(a.to(self.device) for a in args) if self.first else ()
        every_stage = {name: value.to(self.device) for name, value in keywords.items()}
        y = torch.as_tensor(batch[cfg.spec.labels[0]]).to(self.device)
        if cfg.losses[0] in losses.TOKEN_LOSSES:
            count = losses.counted_tokens(cfg.losses[0], y)
            self.tokens_per_microbatch = count.clamp_min(1) / self.plain.cfg.parallel.microbatch_count
        microbatch_losses: List[torch.Tensor] = []
        run = self.schedule.step if torch.is_grad_enabled() else self.schedule.eval
        with self.plain.autocast():
            out = run(*inputs, target=y if self.last else None, losses=microbatch_losses if self.last else None,
                      **every_stage)
        figures = torch.zeros(self.plain.width(), dtype=torch.float64, device=self.device)
        total = torch.zeros((), device=self.device)
        if self.last:
            total = torch.stack([loss.detach().float() for loss in microbatch_losses]).mean()
            ys = [losses.prepare_label(y, out, cfg.losses[0], self.plain.first)]
            figures = self.plain.figures(total, [out], ys, [total])
            self.plain.first = False
        self._share(figures, out if self.last else None)
        return total, [], [], []

    def _share(self, figures: torch.Tensor, out: Optional[torch.Tensor]) -> None:
        import torch.distributed as dist

        dist.broadcast(figures, src=self.last_rank, group=self.group)
        self.figures_now = figures
        if self.output_shapes is None:
            shapes = [[list(out.shape[1:])] if out is not None else None]
            dist.broadcast_object_list(shapes, src=self.last_rank, group=self.group)
            self.output_shapes = shapes[0]

    @override
    def width(self) -> int:
        return self.plain.width()

    @override
    def figures(self, total: torch.Tensor, heads: List[torch.Tensor], ys: List[torch.Tensor],
                head_losses: List[torch.Tensor]) -> torch.Tensor:
        assert self.figures_now is not None, "call the step first"
        return self.figures_now

    def backward(self, loss: torch.Tensor, /) -> None:
        """Nothing: the schedule ran each microbatch's backward as it went."""

    @override
    def optimizer(self, model: torch.nn.Module, given: Any, /) -> Any:
        return self.plain.optimizer(model, given)

    @override
    def fit_began(self, model: torch.nn.Module, /) -> None:
        self.plain.fit_began(model)

    @override
    def train_epoch_began(self, model: torch.nn.Module, /) -> None:
        self.plain.train_epoch_began(model)

    @override
    def train_epoch_ended(self, model: torch.nn.Module, /) -> Dict[str, float]:
        return self.plain.train_epoch_ended(model)

    @override
    def validation_began(self, model: torch.nn.Module, /) -> None:
        self.plain.validation_began(model)

    @override
    def validation_ended(self, model: torch.nn.Module, totals: Totals, /) -> Dict[str, float]:
        return self.plain.validation_ended(model, totals)

    @override
    def fit_ended(self, model: torch.nn.Module, /) -> None:
        self.plain.fit_ended(model)


def write_stages(model: torch.nn.Module, owner: bool, position: int, positions: int, store: Any,
                 directory: str) -> None:
    """Each pipeline position's stages written by one of its ranks (``owner``) as file ``position``
    of Hugging Face's sharded layout (``positions`` files); rank 0 writes the index. A rank holds
    its own stages' whole state (their tensor-parallel and sharded slices put together), never the
    model's (every rank calls it)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mine = saving.distinct_tensors({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}) if owner else {}
    del state
    if dist.get_rank() == 0:
        saving.clear(store, directory)
    names = saving.shard_names(positions)
    everyone: List[Any] = [None] * dist.get_world_size()  # also the barrier after the clear
    dist.all_gather_object(everyone, (position, {k: v.numel() * v.element_size() for k, v in mine.items()})
                           if owner else None)
    if owner:
        store.makedirs(directory)
        saving.write_file(store, directory, names[position], mine)
    if dist.get_rank() == 0:
        held = dict(part for part in everyone if part is not None)
        saving.write_index(store, directory, [(names[i], list(held[i])) for i in range(positions)],
                           sum(n for sizes in held.values() for n in sizes.values()))


def gather_full_state(model: torch.nn.Module, owner: bool) -> Optional[Dict[str, torch.Tensor]]:
    """The whole model's state on rank 0's CPU: each pipeline's stages (their tensor-parallel and
    sharded slices put together first) sent there by one rank per stage (``owner``)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mine = {k: v.detach().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)} if owner else None
    everyone: Optional[List[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    whole: Dict[str, torch.Tensor] = {}
    for part in everyone:
        whole.update(part or {})
    return whole
