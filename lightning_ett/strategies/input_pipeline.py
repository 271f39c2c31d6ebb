"""The next training batch's sparse input distribution, started while this batch trains (ETTStrategy's default).

TorchRec's ``TrainPipelineSparseDist`` runs a loop of its own. Here Lightning's loop keeps control and the
same overlap is made from TorchRec's parts: ``PipelinedForward`` (a sharded module's forward that takes
its already-distributed input from a ``TrainPipelineContext``), ``_start_data_dist`` (every module's
``input_dist`` for a batch, the split sizes of modules sharing a process group fused into one all-to-all
by ``_override_input_dist_forwards``) and ``CallArgs``/``ArgInfo`` (where in the batch each module's
input lives). The schedule is ``TrainPipelineSparseDist.progress``'s:

* batch i+1 is moved to the device (on a side stream on GPUs) and its split sizes' all-to-all starts
  before batch i's forward (``before_step``);
* the split sizes are awaited and the id/length all-to-all started before batch i's backward
  (``before_backward``);
* batch i+1's forward waits for its ids, then looks up and sends the embeddings as usual.

Not reused, and why:

* ``_rewrite_model`` fx-traces ``model(batch)`` to find each module's input. A LightningModule is called
  through ``training_step`` with any signature and is rarely fx-traceable (``self.log``, Python control
  flow). Instead the first training batch of a fit runs unpipelined and each sharded module's arguments
  are found in the batch by identity (:func:`find_in_batch`), giving the path TorchRec's tracer would.
  A module whose input is computed in ``forward`` is not pipelined (said once, at rank zero).
* TorchRec's pipelines own the data iterator. Lightning's fit loop owns it here: the next batch is
  the one Lightning has prefetched (iterable datasets) or one read ahead through :class:`LookAhead`
  (sized loaders), and ``ETTStrategy.batch_to_device`` hands the loop the batch prepared ahead.

What moves earlier, and what does not: the next batch is fetched (a sized loader read one batch
ahead, as Lightning reads iterable ones) and ``transfer_batch_to_device`` runs one step early;
``on_after_batch_transfer`` still runs when the loop asks for the batch. A prepared batch holds only
ids in flight, no model state: the input distribution moves ids, never embeddings, so the pipelined
run computes exactly what the unpipelined one does, and a checkpoint taken at any point holds no
half-distributed batch. Ids replaced or edited in place after they were sent are refused (an error
naming the fix), not trained on: falling back to the module's own distribution on one rank would
mismatch the ranks' collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.tracing import ArgInfoStepFactory
from torchrec.distributed.train_pipeline.types import ArgInfo, CallArgs
from torchrec.distributed.train_pipeline.utils import _override_input_dist_forwards, _start_data_dist
from torchrec.distributed.types import ShardedModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from lightning_ett.durable.errors import ConfigurationError
from lightning_ett.instrument.step_marks import data_read
from lightning_ett.patching import Patches

#: How deep :func:`find_in_batch` looks (``batch.sparse_features`` is depth 1).
SEARCH_DEPTH = 4
NOTHING = object()  #: "no batch": the end of an epoch, or a batch that was not prepared


#: What a batch walk does not look inside: values, tensors, KJTs (found or recorded whole), modules.
_LEAVES = (torch.Tensor, KeyedJaggedTensor, str, bytes, int, float, nn.Module)


def _parts(batch: Any, private: bool) -> list[tuple[bool, Any, Any]]:
    """A batch's parts as ``(by_key, key, part)``: mapping items and sequence items by key, dataclass fields and
    attributes (``_``-prefixed ones only if ``private``) by name. The one rule both walks below follow."""
    if isinstance(batch, _LEAVES):
        return []
    if isinstance(batch, Mapping):
        return [(True, k, v) for k, v in batch.items()]
    if isinstance(batch, (list, tuple)):
        return [(True, i, v) for i, v in enumerate(batch)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [(False, f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)]
    if hasattr(batch, "__dict__"):
        return [(False, k, v) for k, v in vars(batch).items() if private or not k.startswith("_")]
    return []


def find_in_batch(batch: Any, target: object, depth: int = SEARCH_DEPTH) -> ArgInfo | None:
    """The path (attributes, keys, indices) from ``batch`` to the very object ``target``, or None."""
    if batch is target:
        return ArgInfo(steps=[])
    if depth == 0:
        return None
    for by_key, key, part in _parts(batch, private=False):
        found = find_in_batch(part, target, depth - 1)
        if found is not None:
            return found.add_step(ArgInfoStepFactory.get_item(key) if by_key else ArgInfoStepFactory.get_attr(key))
    return None


def call_args_in(batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallArgs | None:
    """Where each argument of a module call lives in ``batch``; None if any was made in ``forward``."""
    found_args = [find_in_batch(batch, arg) for arg in args]
    found_kwargs = {key: find_in_batch(batch, value) for key, value in kwargs.items()}
    if any(info is None for info in [*found_args, *found_kwargs.values()]):
        return None
    return CallArgs(args=found_args, kwargs=found_kwargs)  # type: ignore[arg-type]


def unpipelinable_reason(trainer: pl.Trainer) -> str | None:
    """Why this fit's batches cannot be prepared one step ahead, or None.

    The loop hands ``batch_to_device`` the object it fetched only when ``convert_input`` and
    ``on_before_batch_transfer`` keep it: a prepared batch is recognised by identity.
    """
    module, datamodule = trainer.lightning_module, trainer.datamodule
    if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        return "training_step takes `dataloader_iter` and fetches its own batches"
    if type(trainer.precision_plugin).convert_input is not Precision.convert_input:
        return (f"precision {trainer.precision_plugin.precision!r} converts each input batch; use a '-mixed' precision "
                "to keep the pipeline")
    for owner in (module, datamodule):
        if owner is not None and is_overridden("on_before_batch_transfer", owner):
            return (f"{type(owner).__name__} overrides on_before_batch_transfer, which the pipeline cannot run ahead; "
                    "move that work to on_after_batch_transfer or the dataset")
    return None


class LookAhead(Iterator[Any]):
    """An iterator that can show its next item without giving it (for sized loaders, which Lightning
    does not prefetch)."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator
        self._next: Any = NOTHING

    def peek(self) -> Any:
        """The next item, or ``NOTHING`` at the end."""
        if self._next is NOTHING:
            try:
                self._next = next(self.iterator)
            except StopIteration:
                return NOTHING
        return self._next

    def __next__(self) -> Any:
        if self._next is not NOTHING:
            item, self._next = self._next, NOTHING
            return item
        return next(self.iterator)

    def __getattr__(self, name: str) -> Any:  # the CombinedLoader iterator's own attributes stay reachable
        return getattr(self.__dict__["iterator"], name)


def next_raw_batch(fetcher: Any, read_ahead: bool) -> Any:
    """The batch the fit loop will fetch next, before any hook saw it; ``NOTHING`` at the end of the epoch.

    What Lightning prefetched (iterable loaders), else, with ``read_ahead``, one item read through a
    :class:`LookAhead` (``iter(fetcher)`` makes a new iterator each epoch, so it is wrapped again).
    """
    if fetcher.batches:
        item = fetcher.batches[0]
    elif fetcher.done or fetcher.iterator is None or not read_ahead:
        return NOTHING
    else:
        if not isinstance(fetcher.iterator, LookAhead):
            fetcher.iterator = LookAhead(fetcher.iterator)
        item = fetcher.iterator.peek()
    return item[0] if isinstance(item, tuple) and len(item) == 3 else NOTHING  # (batch, batch_idx, dataloader_idx)


def record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that ``stream`` uses the batch's CUDA tensors (made on another stream).

    Walks the batch itself, private attributes too: ``Tensor.record_stream`` exists for CUDA tensors
    only, and a batch may keep some on the host.
    """
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, KeyedJaggedTensor):
        for tensor in _kjt_tensors(batch):
            record_stream(tensor, stream)
    else:
        for _, _, part in _parts(batch, private=True):
            record_stream(part, stream)


def _kjt_tensors(kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
    return [t for t in (kjt.values(), kjt.weights_or_none(), kjt.lengths_or_none(), kjt.offsets_or_none()) if t is not None]


def tensor_versions(args: list[Any], kwargs: dict[str, Any]) -> list[int]:
    """The in-place version counters of the tensors in a module call's arguments (an edit in place bumps them)."""
    versions = []
    for value in [*args, *kwargs.values()]:
        tensors = _kjt_tensors(value) if isinstance(value, KeyedJaggedTensor) else [value]
        versions += [t._version for t in tensors if isinstance(t, torch.Tensor)]
    return versions


@dataclass
class Prepared:
    """A batch moved to the device ahead, its input distribution in flight."""

    source: Any  # what the loop will hand batch_to_device
    batch: Any  # on the device (transfer_batch_to_device; on_after_batch_transfer runs when the loop asks)
    context: TrainPipelineContext = field(default_factory=lambda: TrainPipelineContext(version=1))
    expected: dict[str, tuple[list[Any], dict[str, Any]]] = field(default_factory=dict)
    versions: dict[str, list[int]] = field(default_factory=dict)


class ModuleForward(PipelinedForward):
    """A sharded module's forward under the pipeline.

    While the first batch is observed it records its arguments and runs the module's own forward.
    Afterwards: TorchRec's ``PipelinedForward`` while this batch's distribution for the module is
    waiting, the module's own forward otherwise (validation, a second call, unprepared batches).
    The distribution waiting is for the prepared batch's own objects, unchanged: anything else
    would train on other ids than the module gets, so it is refused rather than run (running the
    module's own distribution on some ranks only would mismatch the ranks' collectives).
    """

    def __init__(self, name: str, module: ShardedModule, pipeline: SparseInputPipeline) -> None:
        super().__init__(name, CallArgs(args=[], kwargs={}), module, TrainPipelineContext(version=1),
                         pipeline.dist_stream)
        self.own_forward = module.forward
        self.pipeline = pipeline
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline.observing:
            self.calls.append((args, kwargs))
            return self.own_forward(*args, **kwargs)
        if self.name not in self._context.input_dist_tensors_requests:
            return self.own_forward(*args, **kwargs)
        prepared = self.pipeline.current
        assert prepared is not None
        if not _same_objects(prepared.expected[self.name], args, kwargs):
            raise ConfigurationError(
                f"ETTStrategy(pipeline=True): {_short(self.name)} got an input other than the batch's own object, whose "
                "ids were already sent to the other ranks (the input was replaced after the batch was fetched: in "
                "training_step, forward or on_train_batch_start). Pass the batch's object as it is, or use "
                "ETTStrategy(pipeline=False).")
        if tensor_versions(list(args), kwargs) != prepared.versions[self.name]:
            raise ConfigurationError(
                f"ETTStrategy(pipeline=True): the ids {_short(self.name)} gets were changed in place after they were "
                "sent to the other ranks (in on_after_batch_transfer, on_train_batch_start, training_step or forward). "
                "Change them in the dataset, or on a copy, or use ETTStrategy(pipeline=False).")
        self.pipeline.pipelined_calls += 1
        return super().__call__(*args, **kwargs)


def _same_objects(expected: tuple[list[Any], dict[str, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    want_args, want_kwargs = expected
    return (len(want_args) == len(args) and all(a is b for a, b in zip(want_args, args))
            and want_kwargs.keys() == kwargs.keys() and all(want_kwargs[k] is kwargs[k] for k in kwargs))


class SparseInputPipeline:
    """Prepares the next training batch and starts its sparse input distribution (see the module docstring).

    Every collective it starts is started in the same order on every rank: what to pipeline is agreed
    once per fit (``agree``, a collective), and each step prepares the next batch iff the loop will
    train one (as every rank must under data parallelism). Waiting for what was started
    (:meth:`drain`) issues nothing new, so it may differ between ranks.
    """

    def __init__(self, model: nn.Module, device: torch.device, agree: Callable[[list[bool]], list[bool]]) -> None:
        self.device = device
        self.agree = agree  # per-module flags -> True where every rank says True
        on_cuda = device.type == "cuda"  # GPU only: H2D copy and input distribution on their own streams
        self.copy_stream = torch.cuda.Stream(device, priority=-1) if on_cuda else None  # as TorchRec's pipelines
        self.dist_stream = torch.cuda.Stream(device, priority=-1) if on_cuda else None
        self._modules = _top_level_sharded_modules(model)
        self._patches = Patches()
        self._forwards: dict[str, ModuleForward] = {}
        self._pipelined: list[ShardedModule] = []  # what _start_data_dist runs, in a fixed order
        self._pipelined_names: list[str] = []
        # (KJT all-to-all, its forward, the fusing one, whether that forward was its own attribute)
        self._splits_swaps: list[tuple[Any, Any, Any, bool]] | None = None
        self.observing = False
        self.current: Prepared | None = None  # the batch this step trains on, if it was prepared
        self.next: Prepared | None = None
        self._step_batch: Any = NOTHING
        self._default_transfer = True  # Lightning's transfer_batch_to_device (set at attach)
        self._read_ahead: bool | None = None  # may a sized loader be read one batch ahead (decided at first use)
        self._said: set[str] = set()
        self.pipelined_calls = 0  # sharded forwards that used a distribution started a step ahead
        self.prepared_batches = 0
        self.off_reason: str | None = None

    # ----------------------------------------------------------------- attach / detach
    def attach(self, trainer: pl.Trainer) -> None:
        """Swap in the modules' forwards; the first training batch is observed."""
        self.off_reason = unpipelinable_reason(trainer) if self._modules else "the model has no sharded modules"
        if self.off_reason is not None:
            rank_zero_info(f"ETTStrategy(pipeline=True): the sparse input distribution is not pipelined: {self.off_reason}.")
            return
        self._default_transfer = not any(owner is not None and is_overridden("transfer_batch_to_device", owner)
                                         for owner in (trainer.lightning_module, trainer.datamodule))
        for name, module in self._modules.items():
            forward = ModuleForward(name, module, self)
            self._forwards[name] = forward
            self._patches.setattr(module, "forward", forward)
        self.observing = True

    def detach(self) -> None:
        """Wait for what is in flight and give the modules their own forwards back."""
        self.drain()
        self.release()

    def release(self) -> None:
        """Give the modules their own forwards back without waiting (after an error: peers may be gone).
        Idempotent."""
        self.current = self.next = None
        self._unswap_splits()
        self._patches.undo()
        self._forwards.clear()
        self._pipelined, self._pipelined_names, self._splits_swaps = [], [], None
        self.observing = False

    @property
    def active(self) -> bool:
        return bool(self._forwards)

    # ----------------------------------------------------------------- the loop's calls, in order
    def take(self, batch: Any, module: pl.LightningModule, dataloader_idx: int) -> tuple[bool, Any]:
        """``batch_to_device``: ``(True, the prepared device batch)`` through ``on_after_batch_transfer`` now (when
        the unpipelined loop would run it), if ``batch`` is the one prepared; else ``(False, None)``."""
        if self.next is None or self.next.source is not batch:
            return False, None
        prepared, self.next = self.next, None
        if self.copy_stream is not None and self.dist_stream is not None:
            current_stream = torch.cuda.current_stream(self.device)
            current_stream.wait_stream(self.copy_stream)
            current_stream.wait_stream(self.dist_stream)
            record_stream(prepared.batch, current_stream)
        prepared.batch = module._call_batch_hook("on_after_batch_transfer", prepared.batch, dataloader_idx)
        self.current = prepared
        return True, prepared.batch

    def before_step(self, trainer: pl.Trainer, batch: Any) -> None:
        """``training_step`` of ``batch``: point the forwards at its distribution and prepare the next batch."""
        if not self.active or batch is self._step_batch:  # a second closure call for the same batch
            return
        self._step_batch = batch
        if self.current is not None and self.current.batch is not batch:
            self._drain(self.current)
            self.current = None
        if self.current is None and self.next is not None:  # the loop moved on without it (a new epoch)
            self._drain(self.next)
            self.next = None
        if self.current is not None:
            self._wait_splits(self.current)
        context = self.current.context if self.current is not None else TrainPipelineContext(version=1)
        for forward in self._forwards.values():
            forward.set_context(context)
        if not self.observing:
            self.prepare_next(trainer)

    def before_backward(self) -> None:
        """Before this batch's backward: the next batch's split sizes are in; start its ids' all-to-all."""
        if self.next is not None:
            self._wait_splits(self.next)

    def after_step(self, batch: Any) -> None:
        """``training_step`` returned: learn the modules' inputs after the first batch; free what went unused."""
        if self.observing and batch is self._step_batch:
            self._learn(batch)
        if self.current is not None:
            self._drain(self.current)  # a module this batch did not call
            self.current = None

    # ----------------------------------------------------------------- work
    def prepare_next(self, trainer: pl.Trainer) -> None:
        if not self._pipelined or self.next is not None:
            return
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if type(fetcher) is not _PrefetchDataFetcher:  # Lightning's fetching changed: say so, train unpipelined
            self._say_once("fetcher", f"the fit loop's data fetcher is a {type(fetcher).__name__}, not the "
                                      "_PrefetchDataFetcher this version of the pipeline reads ahead from")
            return
        if self._read_ahead is None:
            self._read_ahead = not any(isinstance(loader, _Stateful) for loader in fetcher.combined_loader.flattened)
            if not self._read_ahead and fetcher.length is not None:
                self._say_once("stateful", "the training loader is sized and stateful: reading it a batch ahead "
                                           "would put that batch in its saved state, so a resume would skip it")
        raw = next_raw_batch(fetcher, self._read_ahead)
        if raw is NOTHING or raw is None:  # the end of the epoch; a None batch (Lightning skips it)
            return
        batch = self._transfer(trainer.lightning_module, raw)
        data_read()  # before the forward's collectives: the straggler diagnosis sees a rank slow to read
        prepared = Prepared(source=raw, batch=batch)
        try:
            for name in self._pipelined_names:
                prepared.expected[name] = self._forwards[name].args.build_args_kwargs(batch)
        except (AttributeError, KeyError, IndexError, TypeError):  # this batch is shaped unlike the first
            self._say_once("shape", "a batch did not hold the modules' inputs where the first batch did; "
                                    "such batches train unpipelined")
            return
        self._start(prepared)
        # After the input_dist calls: a module's own may change its input in place before sending it (a row-wise
        # FeatureProcessedEmbeddingBagCollection fills the KJT's weights), as it would unpipelined.
        prepared.versions = {name: tensor_versions(*expected) for name, expected in prepared.expected.items()}
        self.next = prepared
        self.prepared_batches += 1

    def _transfer(self, module: pl.LightningModule, raw: Any) -> Any:
        """``transfer_batch_to_device`` of the next batch, on the copy stream on GPUs. Lightning's default
        copies a TorchRec batch blocking; a ``Pipelineable`` batch is copied ``non_blocking`` as TorchRec does."""
        stream = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext()
        with stream:
            if self._default_transfer and isinstance(raw, Pipelineable):
                return raw.to(device=self.device, non_blocking=True)
            return module._call_batch_hook("transfer_batch_to_device", raw, self.device, 0)

    def _start(self, prepared: Prepared) -> None:
        """Every pipelined module's ``input_dist`` of the batch: split sizes fused per process group."""
        stream = torch.cuda.stream(self.dist_stream) if self.dist_stream is not None else nullcontext()
        with stream:
            if self.dist_stream is not None and self.copy_stream is not None:
                self.dist_stream.wait_stream(self.copy_stream)
                record_stream(prepared.batch, self.dist_stream)
            self._fuse_splits(True)  # only while starting: the modules' own forwards need their all-to-alls back
            try:
                _start_data_dist(self._pipelined, prepared.batch, prepared.context)
            finally:
                self._fuse_splits(False)

    def _fuse_splits(self, on: bool) -> None:
        """Swap the KJT all-to-alls for TorchRec's ``KJTAllToAllForward``, which returns the split sizes as
        metadata so that ``_start_data_dist`` sends all modules' in one all-to-all (made once, then swapped)."""
        if self._splits_swaps is None:
            own = ["forward" in vars(kjt_dist) for kjt_dist in _kjt_dists(self._pipelined)]
            originals = _override_input_dist_forwards(self._pipelined)
            self._splits_swaps = [(kjt_dist, original, kjt_dist.forward, had_own) for kjt_dist, original, had_own
                                  in zip(_kjt_dists(self._pipelined), originals, own, strict=True)]
        for kjt_dist, original, fused, _ in self._splits_swaps:
            kjt_dist.forward = fused if on else original

    def _unswap_splits(self) -> None:
        """The KJT all-to-alls exactly as before (their class's forward, unless they had their own)."""
        for kjt_dist, original, _, own in self._splits_swaps or []:
            if own:
                kjt_dist.forward = original
            else:
                vars(kjt_dist).pop("forward", None)

    def _wait_splits(self, prepared: Prepared) -> None:
        """Split sizes in: start the ids' all-to-all (``TrainPipelineSparseDist.wait_sparse_data_dist``)."""
        context = prepared.context
        if not context.fused_splits_awaitables:
            return
        stream = torch.cuda.stream(self.dist_stream) if self.dist_stream is not None else nullcontext()
        with stream:
            for names, awaitable in context.fused_splits_awaitables:
                for name, request in zip(names, awaitable.wait(), strict=True):
                    context.input_dist_tensors_requests[name] = request
        context.input_dist_splits_requests.clear()
        context.fused_splits_awaitables.clear()

    def _drain(self, prepared: Prepared) -> None:
        """Wait for whatever of ``prepared`` is still in flight and drop it (starts no collective)."""
        self._wait_splits(prepared)
        stream = torch.cuda.stream(self.dist_stream) if self.dist_stream is not None else nullcontext()
        with stream:  # where PipelinedForward waits them
            for request in prepared.context.input_dist_tensors_requests.values():
                request.wait()
        prepared.context.input_dist_tensors_requests.clear()
        prepared.context.module_contexts.clear()

    def drain(self) -> None:
        for prepared in (self.current, self.next):
            if prepared is not None:
                self._drain(prepared)
        self.current = self.next = None
        self._step_batch = NOTHING

    def _learn(self, batch: Any) -> None:
        """After the observed batch: each module's input path in the batch, agreed by every rank."""
        self.observing = False
        found: dict[str, CallArgs | None] = {}
        why: dict[str, str] = {}
        for name, forward in self._forwards.items():
            calls, forward.calls = forward.calls, []
            found[name] = call_args_in(batch, *calls[0]) if len(calls) == 1 else None
            if found[name] is None:
                why[name] = "not called" if not calls else "called more than once" if len(calls) > 1 else "input made in forward"
        everywhere = self.agree([found[name] is not None for name in self._forwards])  # one collective per fit
        for (name, forward), agreed in zip(self._forwards.items(), everywhere, strict=True):
            if agreed:
                forward._args = found[name]
                self._pipelined.append(forward._module)
                self._pipelined_names.append(name)
            elif name not in why:
                why[name] = "its input was not found in another rank's batch"
        if why:
            rank_zero_info("ETTStrategy(pipeline=True): these sharded modules' input distribution is not pipelined: "
                           + ", ".join(f"{_short(name)} ({reason})" for name, reason in why.items())
                           + ". A module is pipelined when its forward gets an object taken from the batch as it is, "
                           "once per batch (decided from the first training batch of the fit).")

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            rank_zero_info(f"ETTStrategy(pipeline=True): {message}.")


def _top_level_sharded_modules(model: nn.Module) -> dict[str, ShardedModule]:
    """Sharded modules not inside another sharded module (those are run by their parent)."""
    found: dict[str, ShardedModule] = {}
    for name, module in model.named_modules():
        if isinstance(module, ShardedModule) and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = module
    return found


def _kjt_dists(modules: list[ShardedModule]) -> Iterator[Any]:
    """The KJT all-to-alls ``_override_input_dist_forwards`` swaps, in its order."""
    for module in modules:
        for _, child in module.named_modules():
            for input_dist in getattr(child, "_input_dists", []):
                if hasattr(input_dist, "_dist"):
                    yield input_dist._dist


def _short(name: str) -> str:
    """A module name without DMP's and DDP's wrapper prefixes."""
    for prefix in ("_dmp_wrapped_module.", "module."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name
