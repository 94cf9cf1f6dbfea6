"""Post-import edits for saving and loading under a distribution.

Like `keras_dtensor._edits`, each edit is one small function applied to an
upstream module after it executes, only under the torch backend; this
module imports neither torch nor keras at module level. The edits act only
while a distribution is set, so plain keras saves exactly as upstream.

One mechanism serves every save path: the save runs on every process (all
of them take part in gathering sharded values), process 0 writes into a
staging folder and renames the result into place, and the other processes
wait for it (`keras.src.saving.distributed_saving`).
"""

import functools
import json
import os
import sys

# `_edits` imports this module first; its functions are used only when
# the edits run, after both modules have executed.
from keras_dtensor import _edit_support as support


def _distribution_is_set():
    """Whether a distribution is active, read as every edit reads it."""
    return support.distribution_accessor()() is not None


def _distributed_saving():
    from keras.src.saving import distributed_saving

    return distributed_saving


def edit_saving_api_save(saving_api):
    """Under a distribution, `save_model` and `save_weights` write from
    process 0, atomically.

    Stands for: in `keras/src/saving/saving_api.py`, when a distribution is
    set, `save_model` and `save_weights` run their body through
    `distributed_saving.save_from_process_zero`.
    """
    if not support.is_torch_backend():
        return
    upstream_save_model = saving_api.save_model
    upstream_save_weights = saving_api.save_weights

    @functools.wraps(upstream_save_model)
    def save_model(model, filepath, overwrite=True, zipped=None, **kwargs):
        if not _distribution_is_set():
            return upstream_save_model(
                model, filepath, overwrite=overwrite, zipped=zipped, **kwargs
            )
        if zipped is None:
            zipped = not str(filepath).startswith("hf://")
        return _distributed_saving().save_from_process_zero(
            lambda path: upstream_save_model(
                model, path, overwrite=True, zipped=zipped, **kwargs
            ),
            filepath,
            "save_model",
            overwrite=overwrite,
        )

    @functools.wraps(upstream_save_weights)
    def save_weights(
        model, filepath, overwrite=True, max_shard_size=None, **kwargs
    ):
        if not _distribution_is_set():
            return upstream_save_weights(
                model,
                filepath,
                overwrite=overwrite,
                max_shard_size=max_shard_size,
                **kwargs,
            )
        return _distributed_saving().save_from_process_zero(
            lambda path: upstream_save_weights(
                model,
                path,
                overwrite=True,
                max_shard_size=max_shard_size,
                **kwargs,
            ),
            filepath,
            "save_weights",
            overwrite=overwrite,
        )

    saving_api.save_model = save_model
    saving_api.save_weights = save_weights


def edit_saving_api_load(saving_api):
    """Under a multi-process distribution, `load_model` and `load_weights`
    check that every process calls them.

    Loading creates or assigns sharded variables on every process; a load
    on one process alone would hang or leave processes out of step. Stands
    for: in `keras/src/saving/saving_api.py`, `load_model` and
    `load_weights` start with `distributed_saving.check_every_process_calls`
    and `restore_interrupted_replace` (for folder saves, on process 0 under
    `distributed_saving.process_zero_writes`) when a distribution is set.
    """
    if not support.is_torch_backend():
        return
    upstream_load_model = saving_api.load_model
    upstream_load_weights = saving_api.load_weights

    def prepare(operation, filepath):
        if not _distribution_is_set():
            return
        distributed_saving = _distributed_saving()
        distributed_saving.check_every_process_calls(operation, filepath)
        if distributed_saving.needs_restore(filepath):
            with distributed_saving.process_zero_writes(
                operation, filepath
            ) as call:
                if call.is_writer:
                    distributed_saving.restore_interrupted_replace(
                        str(filepath)
                    )

    @functools.wraps(upstream_load_model)
    def load_model(filepath, custom_objects=None, compile=True, safe_mode=True):
        prepare("load_model", filepath)
        return upstream_load_model(
            filepath,
            custom_objects=custom_objects,
            compile=compile,
            safe_mode=safe_mode,
        )

    @functools.wraps(upstream_load_weights)
    def load_weights(model, filepath, skip_mismatch=False, **kwargs):
        prepare("load_weights", filepath)
        return upstream_load_weights(
            model, filepath, skip_mismatch=skip_mismatch, **kwargs
        )

    saving_api.load_model = load_model
    saving_api.load_weights = load_weights


def edit_file_utils_makedirs(file_utils):
    """`file_utils.makedirs` accepts a folder another process just created.

    Callbacks such as `ModelCheckpoint` check that a folder is missing, then
    create it; processes doing so together race. Stands for: in
    `keras/src/utils/file_utils.py`, `makedirs` calls
    `os.makedirs(path, exist_ok=True)` for local paths.
    """
    if not support.is_torch_backend():
        return
    upstream_makedirs = file_utils.makedirs

    def makedirs(path):
        if _distribution_is_set() and not file_utils.is_remote_path(path):
            return os.makedirs(path, exist_ok=True)
        return upstream_makedirs(path)

    file_utils.makedirs = makedirs


def _keep_previous_backup(callback):
    """Creates a `BackupAndRestore` folder and its `double_checkpoint` copies.

    Runs on process 0 only.
    """
    from keras.src.utils import file_utils

    os.makedirs(callback.backup_dir, exist_ok=True)
    if not callback.double_checkpoint:
        return
    saving = _distributed_saving()
    for current, previous in (
        (callback._weights_path, callback._prev_weights_path),
        (
            callback._training_metadata_path,
            callback._prev_training_metadata_path,
        ),
    ):
        if file_utils.exists(current):
            saving.copy_file(current, previous)


def _restore_previous_backup(callback):
    """Puts a `BackupAndRestore`'s previous backup back; on process 0 only."""
    from keras.src.utils import file_utils

    saving = _distributed_saving()
    saving.copy_file(callback._prev_weights_path, callback._weights_path)
    if file_utils.exists(callback._prev_training_metadata_path):
        saving.copy_file(
            callback._prev_training_metadata_path,
            callback._training_metadata_path,
        )
    elif file_utils.exists(callback._training_metadata_path):
        file_utils.remove(callback._training_metadata_path)


def _load_or_restore_previous_backup(callback):
    """Loads a `BackupAndRestore` backup, else the previous one.

    As upstream's `on_train_begin`; the previous backup is put back on
    process 0 only, and every process then loads it.
    """
    from keras.src.utils import file_utils

    try:
        callback._load_model()
    except OSError:
        if not file_utils.exists(callback._prev_weights_path):
            raise
        with _distributed_saving().process_zero_writes(
            "BackupAndRestore.restore", callback.backup_dir
        ) as call:
            if call.is_writer:
                _restore_previous_backup(callback)
        callback._load_model()


def _delete_backup(callback):
    """Deletes a `BackupAndRestore` folder; on process 0 only."""
    from keras.src.utils import file_utils

    if file_utils.exists(callback.backup_dir):
        file_utils.rmtree(callback.backup_dir)


def edit_backup_and_restore(module):
    """`BackupAndRestore` changes its files from process 0 only, atomically.

    Stands for: in `keras/src/callbacks/backup_and_restore.py`, under a
    distribution, the metadata is written with
    `distributed_saving.save_from_process_zero`, and the folder creation,
    the copies of `double_checkpoint` and the deletion at the end of
    training run on process 0 under `distributed_saving.process_zero_writes`
    (every process enters, process 0 writes, all learn the outcome).
    """
    if not support.is_torch_backend():
        return
    backup_and_restore = module.BackupAndRestore
    upstream_on_train_begin = backup_and_restore.on_train_begin
    upstream_save_model = backup_and_restore._save_model
    upstream_on_train_end = backup_and_restore.on_train_end

    def on_train_begin(self, logs=None):
        if not _distribution_is_set():
            return upstream_on_train_begin(self, logs)
        _load_or_restore_previous_backup(self)

    def _save_model(self):
        if not _distribution_is_set():
            return upstream_save_model(self)
        saving = _distributed_saving()
        with saving.process_zero_writes(
            "BackupAndRestore.prepare", self.backup_dir
        ) as call:
            if call.is_writer:
                _keep_previous_backup(self)
        self.model.save_weights(filepath=self._weights_path, overwrite=True)
        metadata = json.dumps(
            {"epoch": self._current_epoch, "batch": self._last_batch_seen}
        )
        saving.save_from_process_zero(
            lambda path: saving.write_text(path, metadata),
            self._training_metadata_path,
            "BackupAndRestore.metadata",
        )

    def on_train_end(self, logs=None):
        if not _distribution_is_set():
            return upstream_on_train_end(self, logs)
        if not self.delete_checkpoint:
            return
        with _distributed_saving().process_zero_writes(
            "BackupAndRestore.delete", self.backup_dir
        ) as call:
            if call.is_writer:
                _delete_backup(self)

    backup_and_restore.on_train_begin = on_train_begin
    backup_and_restore._save_model = _save_model
    backup_and_restore.on_train_end = on_train_end


def edit_weights_store_reads_by_part(saving_lib):
    """Under a distribution, Keras's HDF5 weights stores hand out their
    arrays unread, and read a `.keras` archive's weights in place.

    Stands for: in `keras/src/saving/saving_lib.py`, when a distribution
    is set, `H5IOStore.__getitem__` returns a
    `dataset_views.DatasetView` of the dataset (a sharded variable then
    reads only its part, `edit_variable_reads_its_shard`; any other reader
    gets the whole array from `numpy.asarray`), and `H5IOStore` opens an
    archive's member with `zip_members.open_stored_member` where it can.
    A weights file on the disk is opened with
    `dataset_views.open_for_blocks` (no HDF5 sieve buffer, which reads
    whole rows around a block of columns). `ShardedH5IOStore` reads through
    `H5IOStore.__getitem__` and `_get_h5_file`.
    """
    if not support.is_torch_backend():
        return
    store = saving_lib.H5IOStore
    upstream_getitem = store.__getitem__
    upstream_get_h5_file = store._get_h5_file

    def __getitem__(self, key):
        if not _distribution_is_set():
            return upstream_getitem(self, key)
        from keras.src.saving import dataset_views

        dataset = saving_lib.safe_get_h5_dataset(self._h5_entry_group, key)
        return dataset_views.DatasetView(dataset)

    def _get_h5_file(self, path_or_io, mode=None):
        if (mode or self.mode) != "r" or not _distribution_is_set():
            return upstream_get_h5_file(self, path_or_io, mode=mode)
        from keras.src.saving import dataset_views
        from keras.src.saving import zip_members

        if self.archive is None:
            if isinstance(path_or_io, (str, os.PathLike)):
                return dataset_views.open_for_blocks(path_or_io)
            return upstream_get_h5_file(self, path_or_io, mode=mode)
        member = zip_members.open_stored_member(self.archive, str(path_or_io))
        if member is None:
            return upstream_get_h5_file(self, path_or_io, mode=mode)
        self.io_file = member
        return saving_lib.h5py.File(member, mode="r")

    store.__getitem__ = __getitem__
    store._get_h5_file = _get_h5_file


def edit_weights_store_writes_by_chunks(saving_lib):
    """Under a distribution, `H5IOStore` writes a sharded variable as it
    gathers it, a chunk of rows at a time.

    Stands for: in `keras/src/saving/saving_lib.py`, when a distribution
    is set, `H5IOStore.__setitem__` of a variable (or DTensor) whose value
    is sharded, of a dtype numpy (or `ml_dtypes`, for bfloat16, marked as
    upstream marks it) holds, creates the dataset and fills it
    with `shard_writes.write_by_chunks` (each process sends process 0 its
    local tensor a chunk at a time; no process gathers the full value),
    and `ShardedH5IOStore.__setitem__` sizes such a value from its shape
    and dtype (`_sharded_store_writes_by_chunks`).
    """
    if not support.is_torch_backend():
        return
    store = saving_lib.H5IOStore
    upstream_setitem = store.__setitem__

    def __setitem__(self, key, value):
        parameter = _sharded_dtensor(value) if self.mode == "w" else None
        if parameter is None or not _distribution_is_set():
            return upstream_setitem(self, key, value)
        from keras.src.backend.torch import shard_writes

        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        dtype = saving_lib.backend.standardize_dtype(parameter.dtype)
        bfloat16 = dtype == "bfloat16"
        dataset = self._h5_entry_group.create_dataset(
            key,
            shape=tuple(parameter.shape),
            dtype=saving_lib.ml_dtypes.bfloat16 if bfloat16 else dtype,
        )
        if bfloat16:
            # As upstream marks it: h5py stores bfloat16 as opaque values.
            dataset.attrs["dtype"] = "bfloat16"
        shard_writes.write_by_chunks(parameter, dataset.__setitem__)

    store.__setitem__ = __setitem__
    _sharded_store_writes_by_chunks(saving_lib)


def _sharded_store_writes_by_chunks(saving_lib):
    """`ShardedH5IOStore.__setitem__` sizes a sharded variable from its
    shape and dtype, not from its gathered value, and writes it through
    `H5IOStore.__setitem__` (by chunks).

    Part of `edit_weights_store_writes_by_chunks`. Stands for: in
    `ShardedH5IOStore.__setitem__`, the value's size is
    `math.prod(value.shape)` times its dtype's size, without
    `convert_to_numpy` (the rest as it is).
    """
    store = saving_lib.ShardedH5IOStore
    upstream_setitem = store.__setitem__

    def __setitem__(self, key, value):
        parameter = _sharded_dtensor(value) if self.mode == "w" else None
        if parameter is None or not _distribution_is_set():
            return upstream_setitem(self, key, value)
        self._restore_h5_file()
        size = parameter.numel() * parameter.element_size()
        self.total_shard_size += size
        if size > self.max_shard_size:
            raise ValueError(
                f"The size of {key} is {size} bytes, which exceeds the "
                f"maximum shard size of {self.max_shard_size:.0f} bytes. "
                "Increase `max_shard_size`."
            )
        self.current_shard_size += size
        if self.current_shard_size > self.max_shard_size:
            # This variable opens the next file.
            self.close()
            self.h5_file = self._create_new_shard_file()
            self.current_shard_size = size
        saving_lib.H5IOStore.__setitem__(self, key, value)
        _note_file(self, self._h5_entry_group.name)

    store.__setitem__ = __setitem__


def _note_file(store, group):
    """Records in a sharded store's index that `group` has values in the
    current file: a file name, or a list of them once there are several
    (the index upstream writes)."""
    weight_map = store.sharding_config["weight_map"]
    name = store.current_shard_path.name
    files = weight_map.get(group)
    if files is None:
        weight_map[group] = name
    elif not isinstance(files, list):
        if files != name:
            weight_map[group] = [files, name]
        else:
            weight_map[group] = [files]
    elif name not in files:
        files.append(name)


def _sharded_dtensor(value):
    """The sharded DTensor value of a variable or DTensor, or None."""
    from torch.distributed.tensor import DTensor

    value = getattr(value, "_value", value)
    if not isinstance(value, DTensor):
        return None
    if not any(p.is_shard() for p in value.placements):
        return None
    return value


def edit_optimizer_saves_variables(base_optimizer):
    """Under a distribution, an optimizer saves its variables, not their
    gathered numpy values, so that the weights store gathers them as it
    writes (`edit_weights_store_writes_by_chunks`).

    Stands for: in `keras/src/optimizers/base_optimizer.py`,
    `BaseOptimizer.save_own_variables` stores `variable` rather than
    `variable.numpy()` (every store converts what it is given).
    """
    if not support.is_torch_backend():
        return
    optimizer = base_optimizer.BaseOptimizer
    upstream_save_own_variables = optimizer.save_own_variables

    def save_own_variables(self, store):
        if not _distribution_is_set():
            return upstream_save_own_variables(self, store)
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable

    optimizer.save_own_variables = save_own_variables


def edit_keras_archive_loads_in_place(saving_lib):
    """Under a distribution, `load_model` of a `.keras` archive reads its
    weights in place, and saving one writes them through a file.

    Upstream copies the archive's weights file into memory (or extracts it
    onto the disk) before loading, on every process, and saves it into
    memory before adding it to the archive. Stands for: in
    `keras/src/saving/saving_lib.py`, when a distribution is set,
    `_load_model_from_fileobj` opens its weights store on the archive's
    member (`zip_members.load_model_in_place`), the model's sharded
    variables created empty and initialized only where the file does not
    write them (`deferred_initialization.loading_created_variables`);
    and `is_memory_sufficient` is false, so that `_save_model_to_fileobj`
    writes the weights into a file beside the archive and copies that
    in.
    """
    if not support.is_torch_backend():
        return
    upstream_load = saving_lib._load_model_from_fileobj
    upstream_is_memory_sufficient = saving_lib.is_memory_sufficient

    def _load_model_from_fileobj(fileobj, custom_objects, compile, safe_mode):
        if not _distribution_is_set():
            return upstream_load(fileobj, custom_objects, compile, safe_mode)
        from keras.src.backend.torch import deferred_initialization
        from keras.src.saving import zip_members

        # The variables the model is created with are overwritten by the
        # weights: they get initial values only where the file has none.
        with deferred_initialization.loading_created_variables():
            return zip_members.load_model_in_place(
                fileobj, custom_objects, compile, safe_mode
            )

    def is_memory_sufficient(model):
        if _distribution_is_set():
            return False
        return upstream_is_memory_sufficient(model)

    saving_lib._load_model_from_fileobj = _load_model_from_fileobj
    saving_lib.is_memory_sufficient = is_memory_sufficient


def edit_variable_reads_its_shard(core):
    """A distributed variable assigned a saved array reads only its part.

    Stands for: in `keras/src/backend/torch/core.py`, `Variable.assign`
    (new, over `KerasVariable.assign`) writes a `DatasetView` of the
    variable's shape into a variable whose value is a DTensor with
    `shard_reads.assign_from_view` (each process reads its local
    tensor's blocks from the file, a chunk of rows at a time, into the
    local tensor); in a stateless scope, and for every other value, as
    upstream.
    """
    from torch.distributed.tensor import DTensor

    from keras.src.backend.common.stateless_scope import in_stateless_scope

    upstream_assign = core.Variable.assign

    def assign(self, value):
        parameter = getattr(self, "_value", None)
        if (
            isinstance(parameter, DTensor)
            and _is_view_of(value, parameter)
            and not in_stateless_scope()
        ):
            from keras.src.backend.torch import shard_reads

            shard_reads.assign_from_view(parameter, value, self._dtype)
            return parameter
        return upstream_assign(self, value)

    core.Variable.assign = assign


def _is_view_of(value, parameter):
    """Whether `value` is a saved array, unread, of `parameter`'s shape (a
    view of another shape is read whole, for upstream's shape error)."""
    # No view exists before its module is imported.
    dataset_views = sys.modules.get("keras.src.saving.dataset_views")
    return (
        dataset_views is not None
        and isinstance(value, dataset_views.DatasetView)
        and tuple(value.shape) == tuple(parameter.shape)
    )


# Upstream module name -> function returning the edits for that module.
POST_IMPORT_EDITS = {
    "keras.src.saving.saving_api": lambda: [
        edit_saving_api_save,
        edit_saving_api_load,
    ],
    "keras.src.utils.file_utils": lambda: [edit_file_utils_makedirs],
    "keras.src.callbacks.backup_and_restore": lambda: [edit_backup_and_restore],
    "keras.src.saving.saving_lib": lambda: [
        edit_weights_store_reads_by_part,
        edit_weights_store_writes_by_chunks,
        edit_keras_archive_loads_in_place,
    ],
    "keras.src.optimizers.base_optimizer": lambda: [
        edit_optimizer_saves_variables
    ],
    "keras.src.backend.torch.core": lambda: [edit_variable_reads_its_shard],
}
