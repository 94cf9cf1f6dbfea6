"""Saving from process 0 with atomic writes, for distributed models.

Under a distribution, every process runs a save, because gathering sharded
values takes all of them, but only process 0 writes the file. It writes
into a staging folder beside the destination and moves the result into
place with a rename, so the destination always holds either the previous
file or the complete new one, even if the process is killed. The other
processes write into a temporary folder of their own, which is deleted,
and return once process 0 has published the file.
"""

import io
import os
import shutil
import tempfile
import uuid

from keras.src.utils import file_utils

_STAGING_TAG = "staging"
_PREVIOUS_TAG = "previous"


def save_from_process_zero(save_fn, filepath, operation, overwrite=True):
    """Runs a save on every process; only process 0's output is kept.

    The save is coordinated by `process_zero_writes`: a process that saves
    alone gets an error, and process 0's failure reaches every process.

    Args:
        save_fn: function taking the path (or file object) to write to. It
            must write exactly what it would write at `filepath`.
        filepath: destination path, or a file object.
        operation: name of the call, e.g. `"save_model"`, for coordination
            and messages.
        overwrite: whether an existing destination may be replaced.

    Returns:
        What `save_fn` returned.
    """
    with process_zero_writes(operation, filepath) as call:
        if not isinstance(filepath, io.IOBase):
            filepath = str(filepath)
            if not _may_write(filepath, overwrite, call):
                return None
        target, work_dir = _save_target(filepath, call)
        try:
            result = save_fn(target)
            if call.is_writer and work_dir is not None:
                publish_staging_dir(work_dir, filepath, call.token)
        finally:
            if work_dir is not None:
                shutil.rmtree(work_dir, ignore_errors=True)
    return result


def process_zero_writes(operation, target=None):
    """Every process enters, process 0 writes, all learn the outcome.

    The coordination of the torch backend's `process_sync`; see
    `keras.src.backend.torch.process_sync.process_zero_writes` for the
    protocol and its timeouts.

    Args:
        operation: name of the call, e.g. `"save_model"`.
        target: the file, folder or file object of the call, for messages.

    Returns:
        A context manager giving a call with `is_writer` and `token`.
    """
    return _process_sync().process_zero_writes(operation, _describe(target))


def check_every_process_calls(operation, target=None):
    """Raises unless every process calls `operation` (multi-process only).

    Args:
        operation: name of the call, e.g. `"load_model"`.
        target: the file or folder of the call, for messages.
    """
    sync = _process_sync()
    if sync.is_multi_process():
        sync.enter(operation, _describe(target))


def is_local_path(filepath):
    """Returns whether `filepath` is on the local file system."""
    return not file_utils.is_remote_path(str(filepath)) and not str(
        filepath
    ).startswith("hf://")


def make_staging_dir(filepath, token):
    """Creates the staging folder for `filepath`, beside it.

    Args:
        filepath: the destination path.
        token: a string that makes the folder name unique to one save.

    Returns:
        The path of the (existing) staging folder.
    """
    path = _sibling(filepath, _STAGING_TAG, token)
    os.makedirs(path, exist_ok=True)
    return path


def publish_staging_dir(staging_dir, filepath, token):
    """Moves what a save wrote in `staging_dir` to the destination.

    Each file or folder in `staging_dir` replaces its namesake beside
    `filepath` with a rename. Index files (the destination itself and any
    `.json` file) are moved last, so that an index never names missing
    files. Leftovers of interrupted saves of `filepath` are then removed.

    Args:
        staging_dir: the staging folder (see `make_staging_dir`).
        filepath: the destination path.
        token: the token the staging folder was made with.
    """
    parent = _parent(filepath)
    name = _basename(filepath)
    entries = sorted(
        os.listdir(staging_dir),
        key=lambda entry: (entry == name or entry.endswith(".json"), entry),
    )
    for entry in entries:
        replace(
            os.path.join(staging_dir, entry),
            os.path.join(parent, entry),
            token,
        )
    remove_leftovers(filepath)


def replace(source, destination, token):
    """Atomically replaces `destination` with `source` (file or folder).

    A file replaces a file with one `os.replace`, after an `fsync`. A folder
    cannot be renamed onto a non-empty folder, so the old folder is first
    renamed aside and deleted after the new one is in place; if the process
    is killed between the two renames, `restore_interrupted_replace` puts
    the old folder back.

    Args:
        source: the new file or folder.
        destination: the path to replace.
        token: a string unique to this save, for the aside name.
    """
    if not os.path.isdir(source):
        _fsync(source)
        os.replace(source, destination)
        _fsync_dir(_parent(destination))
        return
    aside = None
    if os.path.lexists(destination):
        aside = _sibling(destination, _PREVIOUS_TAG, token)
        os.rename(destination, aside)
    os.rename(source, destination)
    _fsync_dir(_parent(destination))
    if aside is not None:
        _remove(aside)


def restore_interrupted_replace(filepath):
    """Puts back a folder whose replacement was interrupted.

    If `filepath` is missing and a folder that `replace` renamed aside
    exists, that folder (the last complete save) is renamed back.

    Args:
        filepath: the destination path.

    Returns:
        Whether a folder was restored.
    """
    if not is_local_path(filepath) or os.path.lexists(filepath):
        return False
    previous = _leftovers(filepath, _PREVIOUS_TAG)
    if not previous:
        return False
    latest = max(previous, key=os.path.getmtime)
    os.rename(latest, filepath)
    return True


def needs_restore(filepath):
    """Returns whether `restore_interrupted_replace` has work to do."""
    if not isinstance(filepath, (str, os.PathLike)):
        return False
    filepath = os.fspath(filepath)
    return (
        is_local_path(filepath)
        and not os.path.lexists(filepath)
        and bool(_leftovers(filepath, _PREVIOUS_TAG))
    )


def remove_leftovers(filepath):
    """Removes staging and aside folders left by interrupted saves."""
    for path in _leftovers(filepath, _STAGING_TAG) + _leftovers(
        filepath, _PREVIOUS_TAG
    ):
        _remove(path)


def write_text(filepath, text):
    """Writes `text` to the file `filepath`."""
    with file_utils.File(filepath, "w") as f:
        f.write(text)


def copy_file(source, destination):
    """Copies a file so that `destination` is never partly written."""
    if not is_local_path(destination):
        file_utils.copy(source, destination)
        return
    token = uuid.uuid4().hex
    staging = make_staging_dir(destination, token)
    try:
        staged = os.path.join(staging, _basename(destination))
        shutil.copyfile(source, staged)
        replace(staged, destination, token)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_target(filepath, call):
    """Where this process's save writes, and the folder to delete after.

    Process 0 writes a local file in a staging folder beside it (published
    with renames), and a remote path or a file object directly. The other
    processes write into a temporary folder of their own, or a buffer.

    Returns:
        `(target, work_dir)`: the path or file object to pass to the save,
        and the folder to delete afterwards (or `None`).
    """
    if isinstance(filepath, io.IOBase):
        return (filepath if call.is_writer else io.BytesIO()), None
    name = _basename(filepath)
    if not call.is_writer:
        work_dir = tempfile.mkdtemp(prefix="keras_discarded_save_")
    elif is_local_path(filepath):
        work_dir = make_staging_dir(filepath, call.token)
    else:
        return filepath, None
    return os.path.join(work_dir, name), work_dir


def _may_write(filepath, overwrite, call):
    """Whether to write `filepath`, asking as upstream does when alone."""
    if overwrite or not file_utils.exists(filepath):
        return True
    if not call.is_coordinated:
        from keras.src.utils import io_utils

        return io_utils.ask_to_proceed_with_overwrite(filepath)
    raise FileExistsError(
        f"Not overwriting '{filepath}': `overwrite=False` and the file "
        "exists. Under a multi-process distribution, saving cannot ask "
        "whether to overwrite; pass `overwrite=True` or remove the file."
    )


def _describe(filepath):
    if filepath is None or isinstance(filepath, io.IOBase):
        return None
    return str(filepath)


def _basename(filepath):
    return os.path.basename(str(filepath).rstrip("/\\"))


def _parent(filepath):
    return os.path.dirname(os.path.abspath(str(filepath).rstrip("/\\")))


def _sibling(filepath, tag, token):
    return os.path.join(
        _parent(filepath), f".{_basename(filepath)}.{tag}-{token}"
    )


def _leftovers(filepath, tag):
    parent = _parent(filepath)
    prefix = f".{_basename(filepath)}.{tag}-"
    if not os.path.isdir(parent):
        return []
    return [
        os.path.join(parent, entry)
        for entry in sorted(os.listdir(parent))
        if entry.startswith(prefix)
    ]


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path):
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _process_sync():
    # The coordination is backend specific; only the torch backend uses it.
    from keras.src.backend.torch import process_sync

    return process_sync
