"""A fitted model's weights as the ecosystem loads them, under a saved model's ``model/`` directory:
a Hugging Face directory for a transformers model (config, safetensors, the tokenizer's files), peft's
adapter directory for a LoRA fit kept unmerged, ``model.safetensors`` for a plain torch module; and
read back without unpickling any weights (the pickled parts of a saved model are code)."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch

from ..data import Store
from ..trainer import pretrained
from ..trainer.saving import write_safetensors
from .fitted import FittedWeights, empty_module

MODEL_DIR = "model"
TRANSFORMERS, PEFT, SAFETENSORS = "transformers", "peft", "safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_WEIGHTS = "sparkring-base"  # a LoRA fit's base, where no checkpoint on storage holds it
COPY_CHUNK_BYTES = 16 * 2**20  # a copy between two filesystems streams through the driver in pieces of this size


def form_of(module: torch.nn.Module) -> str:
    """How ``module``'s weights are saved: 'peft', 'transformers' or 'safetensors'.

    >>> form_of(torch.nn.Linear(2, 1))
    'safetensors'
    """
    if hasattr(module, "peft_config") and hasattr(module, "get_base_model"):
        return PEFT
    if hasattr(module, "save_pretrained") and hasattr(module, "config"):
        return TRANSFORMERS
    return SAFETENSORS


@dataclass(frozen=True)
class Export:
    """What a save wrote: the form, and the model Param's value pickled beside it (code only: a
    factory, or a module's skeleton; None where the directory alone builds the model)."""

    form: str
    recipe: Any


def export(module: torch.nn.Module, recipe: Any, tokenizer: Any, store: Store) -> Export:
    """Write ``module``'s weights under ``store``'s ``model/`` (``recipe``: the model Param that built it).

    >>> export(model.getModel(), recipe, tokenizer, Store("/tmp/m")).form  # doctest: +SKIP
    'transformers'
    """
    form = form_of(module)
    directory = store.path(MODEL_DIR)
    if form == SAFETENSORS:
        write_safetensors(store, directory, module.state_dict())
        return Export(form, pretrained.skeleton(recipe))
    save_pretrained = cast(Any, module).save_pretrained  # a transformers or peft model's own writer
    with tempfile.TemporaryDirectory() as local:
        if form == TRANSFORMERS:
            save_pretrained(local, safe_serialization=True, max_shard_size="5GB")  # an index above 5 GB
            _save_tokenizer(tokenizer, local)
        else:
            save_pretrained(local, safe_serialization=True)
        _upload(store, local, directory)
    if form == TRANSFORMERS:
        return Export(form, None)
    if not pretrained.empty_model(empty_recipe(recipe), None, store.storage_options).sources:
        # the base came as a module, from no checkpoint: its values are saved beside the adapters
        write_safetensors(store, f"{directory}/{BASE_WEIGHTS}", module.state_dict())
    return Export(form, pretrained.skeleton(recipe))


def export_stored(weights: FittedWeights, recipe: Any, tokenizer: Any, store: Store) -> Optional[Export]:
    """Write a fit's weights under ``store``'s ``model/`` as copies of the safetensors its ranks wrote
    (streamed from storage to storage: the driver never holds them), with a transformers model's
    config and tokenizer beside them; None where those files are not what the ecosystem loads as they
    are (peft's adapters, a model whose checkpoints name its tensors otherwise: ``export`` writes those).

    >>> export_stored(model.weights, recipe, None, Store("/tmp/m")).form  # doctest: +SKIP
    'safetensors'
    """
    empty = empty_module(recipe, weights.storage_options)
    form = form_of(empty)
    if form == PEFT or form == TRANSFORMERS and not _saved_under_its_own_names(empty):
        return None
    directory = store.path(MODEL_DIR)
    _copy_weight_files(Store(weights.url, weights.storage_options), store, directory)
    if form == SAFETENSORS:
        return Export(form, pretrained.skeleton(recipe))
    with tempfile.TemporaryDirectory() as local:
        _save_config(empty, local)
        _save_tokenizer(tokenizer, local)
        _upload(store, local, directory)
    return Export(form, None)


def _saved_under_its_own_names(empty: torch.nn.Module) -> bool:
    """Whether save_pretrained writes ``empty``'s tensors under its state_dict's names (it reverts the
    renamings and fusions from_pretrained applies, which some architectures have)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = empty.state_dict()
    try:
        return set(revert_weight_conversion(cast(Any, empty), dict(state))) == set(state)
    except Exception:  # noqa: BLE001 - a conversion that cannot run on meta tensors: written by save_pretrained
        return False


def _copy_weight_files(source: Store, store: Store, directory: str) -> None:
    """The safetensors files (and their index) in ``source``'s root copied into ``directory`` of ``store``."""
    import pyarrow.fs as pafs

    store.makedirs(directory)
    for name in source.listdir(source.root):
        if not (name.endswith(".safetensors") or name.endswith(".safetensors.index.json")):
            continue
        local_from, local_to = source.local_path(source.path(name)), store.local_path(f"{directory}/{name}")
        if local_from is not None and local_to is not None:
            shutil.copyfile(local_from, local_to)  # the kernel copies (pyarrow's local copy_file was erratic)
        elif source.fs.equals(store.fs):  # one filesystem copies by itself (an object store without download)
            store.fs.copy_file(source.path(name), f"{directory}/{name}")
        else:
            pafs.copy_files(source.path(name), f"{directory}/{name}", source_filesystem=source.fs,
                            destination_filesystem=store.fs, chunk_size=COPY_CHUNK_BYTES)


def _save_config(empty: Any, local: str) -> None:
    """What save_pretrained writes beside the weights: the config (with the weights' dtype and the
    architecture's class) and, for a model that generates, its generation config."""
    empty.config.dtype = str(empty.dtype).split(".")[1]
    empty.config.architectures = [type(empty).__name__]
    empty.config.save_pretrained(local)
    if empty.can_generate():
        empty.generation_config.save_pretrained(local)


def empty_recipe(recipe: Any) -> Any:
    """A factory for ``recipe`` (a module stands for itself)."""
    return recipe if callable(recipe) and not isinstance(recipe, torch.nn.Module) else (lambda: recipe)


def transformers_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer Param as a transformers tokenizer (a tokenizers.Tokenizer through the fast
    wrapper, a local directory loaded), or None where there is none.

    >>> transformers_tokenizer(None) is None
    True
    """
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    inner = getattr(tokenizer, "tokenizer", tokenizer)  # an Encoder around the user's tokenizer
    if type(inner).__name__ == "Tokenizer" and hasattr(inner, "to_str"):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=inner)
    return None


def _save_tokenizer(tokenizer: Any, local: str) -> None:
    """The tokenizer's files beside the weights."""
    found = transformers_tokenizer(tokenizer)
    if found is not None:
        found.save_pretrained(local)


def _upload(store: Store, local: str, directory: str) -> None:
    store.makedirs(directory)
    for name in sorted(os.listdir(local)):
        with open(os.path.join(local, name), "rb") as f:
            store.write_bytes(f"{directory}/{name}", f.read())


def imported(export_form: str, recipe: Any, store: Store) -> tuple:
    """What a loaded model holds: (the model Param, FittedWeights to read lazily or None, the module
    read now or None), from a saved ``model/`` directory of ``export_form``."""
    url = store.url_of(store.path(MODEL_DIR))
    if export_form == TRANSFORMERS:
        return url, FittedWeights(url, store.storage_options, executors_read=False), None
    if export_form == SAFETENSORS:
        return recipe, FittedWeights(url, store.storage_options, executors_read=False), None
    return recipe, None, _peft_model(recipe, store, url)


def _peft_model(recipe: Any, store: Store, url: str) -> torch.nn.Module:
    """A LoRA fit's model: its base read where the factory reads it (or from the saved base), then
    peft's adapters from the adapter directory."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load

    options = store.storage_options
    base = f"{url}/{BASE_WEIGHTS}"
    if store.exists(store.path(MODEL_DIR, BASE_WEIGHTS)):
        module = FittedWeights(base, options).load(recipe, torch.device("cpu"))
    else:
        stored: Optional[pretrained.StoredModel] = pretrained.stored_model(empty_recipe(recipe), None, options)
        if stored is None:
            stored = pretrained.StoredModel(empty_module(recipe, options), [])
        module = pretrained.materialized(stored, torch.device("cpu"))
    set_peft_model_state_dict(module, load(store.read_bytes(store.path(MODEL_DIR, ADAPTER_WEIGHTS))))
    return module.eval()
