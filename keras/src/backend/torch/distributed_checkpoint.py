"""Sharded checkpoints of Keras models, with `torch.distributed.checkpoint`.

A sharded checkpoint is a folder written by every process together: each
process writes only the shards of the variables it holds, so no process
ever gathers a full variable. It holds the model's variables (weights and
random seed states) and, optionally, the optimizer's variables, including
`iterations`. Loading reads, on every process, just the slices of the
process's own shards, so a checkpoint loads onto any mesh or number of
processes, and also in a single process without any process group.

Keys are paths within the model, derived from its structure the way Keras
saving names objects (attribute names, and class names within lists), so
that two instances of one architecture, built in any process, have the same
keys. A layer's variable is keyed `<layer path>/<variable name>`, e.g.
`layers/dense/kernel`; an optimizer variable of a model variable is keyed
`optimizer/<model variable key>/<slot>`, e.g.
`optimizer/layers/dense/kernel/momentum`; other optimizer variables are
keyed by name, e.g. `optimizer/iteration`.
"""

import os
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from keras.src.backend.torch import process_sync
from keras.src.optimizers import base_optimizer
from keras.src.saving import distributed_saving
from keras.src.saving import saving_lib
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.utils import naming


def checkpoint_variables(model, include_optimizer=True):
    """Returns the variables of a model's sharded checkpoint, by key.

    Args:
        model: a built Keras model.
        include_optimizer: whether to include the optimizer's variables.

    Returns:
        A dict mapping each checkpoint key to its `keras.Variable`, with
        the model's variables first.

    Raises:
        ValueError: if the model is not built.
    """
    if not model.built:
        raise ValueError(
            "A sharded checkpoint needs a built model, so that its variables "
            f"exist. Model {model.name} is not built: call it on a batch of "
            "data or call `build()` first."
        )
    owners = _owners_by_path(model)
    keyed = _model_variable_keys(model, owners)
    if include_optimizer and getattr(model, "optimizer", None) is not None:
        for path, owner in owners:
            if isinstance(owner, base_optimizer.BaseOptimizer):
                _add_optimizer_variable_keys(path, owner, keyed)
    return {key: variable for key, variable in keyed.values()}


def save_checkpoint(model, directory, include_optimizer=True):
    """Saves a sharded checkpoint of a model into `directory`.

    Every process must call it (as SPMD code does); each writes the shards
    of the variables it holds. The checkpoint is written into a staging
    folder beside `directory`, then renamed into place by process 0: a save
    that is interrupted leaves the previous checkpoint in `directory`.

    Args:
        model: a built Keras model.
        directory: the checkpoint folder; an existing one is replaced.
        include_optimizer: whether to save the optimizer's variables.

    Returns:
        `None`; the checkpoint is in `directory` on return, on every
        process.

    Raises:
        ValueError: if the model is not built.
        RuntimeError: under several processes, if a process does not call
            `save_checkpoint` within `KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS`;
            on processes other than 0, if process 0 failed to put the
            checkpoint in place (process 0 raises its own error).
    """
    variables = checkpoint_variables(model, include_optimizer)
    state = {key: _tensor(variable) for key, variable in variables.items()}
    directory = os.fspath(directory)
    with process_sync.process_zero_writes("save_checkpoint", directory) as call:
        staging_dir = distributed_saving.make_staging_dir(directory, call.token)
        _run_quietly(
            dcp.save,
            state,
            storage_writer=dcp.FileSystemWriter(staging_dir),
            no_dist=not dist.is_initialized(),
        )
        if call.is_writer:
            distributed_saving.restore_interrupted_replace(directory)
            distributed_saving.replace(staging_dir, directory, call.token)
            distributed_saving.remove_leftovers(directory)


def load_checkpoint(model, directory, include_optimizer=True):
    """Loads a sharded checkpoint into a model, in the model's layouts.

    Every process must call it (as SPMD code does). The checkpoint may have
    been saved on another mesh or number of processes; each process reads
    what its own shards need. Without a process group (a single process),
    the full values are read.

    Args:
        model: a built Keras model of the saved architecture. An optimizer
            that is not built yet is built first.
        directory: the checkpoint folder.
        include_optimizer: whether to load the optimizer's variables.

    Returns:
        `None`; the model's (and optimizer's) variables hold the saved
        values on return, in their own layouts.

    Raises:
        ValueError: if the model is not built, or the checkpoint lacks a
            variable of the model or holds it with another shape.
        RuntimeError: under several processes, if a process does not call
            `load_checkpoint` within `KERAS_DTENSOR_SYNC_TIMEOUT_SECONDS`,
            or process 0 failed to restore a checkpoint whose replacement
            was interrupted.
    """
    directory = os.fspath(directory)
    distributed_saving.check_every_process_calls("load_checkpoint", directory)
    if distributed_saving.needs_restore(directory):
        with process_sync.process_zero_writes(
            "load_checkpoint.restore", directory
        ) as call:
            if call.is_writer:
                distributed_saving.restore_interrupted_replace(directory)
    optimizer = getattr(model, "optimizer", None)
    if include_optimizer and optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    variables = checkpoint_variables(model, include_optimizer)
    reader = dcp.FileSystemReader(directory)
    _check_compatible(variables, reader.read_metadata(), directory)
    state = {key: _tensor(variable) for key, variable in variables.items()}
    _run_quietly(
        dcp.load,
        state,
        storage_reader=reader,
        no_dist=not dist.is_initialized(),
    )


def _owners_by_path(model):
    """Lists `(path, object)` for the saveable objects of a model.

    Paths follow Keras saving (`saving_lib._save_state`): attribute names,
    and snake-cased class names, made unique, within lists and dicts.
    Objects are listed once, at the first path that reaches them.
    """
    owners = []
    seen = set()

    def visit(saveable, path):
        if id(saveable) in seen:
            return
        seen.add(id(saveable))
        owners.append((path, saveable))
        for attr, child in saving_lib._walk_saveable(saveable):
            child_path = f"{path}/{attr}" if path else attr
            if isinstance(child, KerasSaveable):
                visit(child, child_path)
            elif isinstance(child, (list, dict, tuple)):
                visit_container(child, child_path, set())

    def visit_container(container, path, seen_containers):
        if id(container) in seen_containers:
            return
        seen_containers.add(id(container))
        if isinstance(container, dict):
            container = list(container.values())
        used_names = {}
        for item in container:
            if isinstance(item, KerasSaveable):
                name = saving_lib._get_unique_name(
                    naming.to_snake_case(item.__class__.__name__), used_names
                )
                visit(item, f"{path}/{name}")
            elif isinstance(item, (list, dict, tuple)):
                name = saving_lib._get_unique_name("container", used_names)
                visit_container(item, f"{path}/{name}", seen_containers)

    visit(model, "")
    return owners


def _own_variables(owner):
    """The variables a layer tracks itself (not its sublayers'), by name."""
    variables = []
    for attr in ("_trainable_variables", "_non_trainable_variables"):
        variables.extend(getattr(owner, attr, None) or [])
    for seed_generator in getattr(owner, "_seed_generators", None) or []:
        variables.append(seed_generator.state)
    return variables


def _model_variable_keys(model, owners):
    """Keys `model.variables`: maps `id(variable)` to `(key, variable)`."""
    wanted = {id(v) for v in model.variables}
    keyed = {}
    used = set()
    for path, owner in owners:
        if isinstance(owner, base_optimizer.BaseOptimizer):
            continue
        own = [v for v in _own_variables(owner) if id(v) in wanted]
        names = [_variable_name(v) for v in own]
        for index, variable in enumerate(own):
            if id(variable) in keyed:
                continue
            name = names[index]
            if names.count(name) > 1:
                name = f"{name}_{names[:index].count(name)}"
            key = _unique(f"{path}/{name}" if path else name, used)
            keyed[id(variable)] = (key, variable)
    for variable in model.variables:
        if id(variable) not in keyed:
            # Not reachable through attributes: keyed by its own path.
            keyed[id(variable)] = (_unique(variable.path, used), variable)
    return keyed


def _add_optimizer_variable_keys(path, optimizer, keyed):
    """Adds the variables of `optimizer`, found at `path`, to `keyed`.

    A variable the optimizer made for a model variable (named
    `<model variable path with _>_<slot>`, as `add_variable_from_reference`
    names it) is keyed by that model variable's key and the slot name.
    """
    used = {key for key, _ in keyed.values()}
    prefixes = []
    for variable in getattr(optimizer, "_trainable_variables", None) or []:
        if id(variable) in keyed:
            prefix = variable.path.replace("/", "_") + "_"
            prefixes.append((prefix, keyed[id(variable)][0]))
    prefixes.sort(key=lambda item: len(item[0]), reverse=True)
    for variable in optimizer.variables:
        if id(variable) in keyed:
            continue
        name = _variable_name(variable)
        key = f"{path}/{name}"
        for prefix, model_key in prefixes:
            if name.startswith(prefix):
                key = f"{path}/{model_key}/{name[len(prefix) :]}"
                break
        keyed[id(variable)] = (_unique(key, used), variable)


def _variable_name(variable):
    return variable.name.split("/")[-1].split(":")[0]


def _unique(key, used):
    candidate = key
    suffix = 1
    while candidate in used:
        candidate = f"{key}_{suffix}"
        suffix += 1
    used.add(candidate)
    return candidate


def _tensor(variable):
    """The tensor of a variable, sharing its storage (DTensor or plain)."""
    return variable.value.detach()


def _check_compatible(variables, metadata, directory):
    """Raises a `ValueError` naming missing keys and shape mismatches."""
    saved = metadata.state_dict_metadata
    missing = [key for key in variables if key not in saved]
    mismatched = []
    for key, variable in variables.items():
        if key in saved and hasattr(saved[key], "size"):
            saved_shape = tuple(saved[key].size)
            if saved_shape != tuple(variable.shape):
                mismatched.append(
                    f"{key}: saved {saved_shape}, model {tuple(variable.shape)}"
                )
    if not missing and not mismatched:
        return
    message = f"The checkpoint '{directory}' does not fit the model."
    if missing:
        message += (
            f" Missing keys: {missing}. Keys in the checkpoint: "
            f"{sorted(saved)}."
        )
    if mismatched:
        message += f" Shape mismatches: {mismatched}."
    raise ValueError(message)


def _run_quietly(fn, *args, **kwargs):
    """Runs a DCP function without its single-process warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled"
        )
        return fn(*args, **kwargs)
