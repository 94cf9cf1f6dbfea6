"""A `.keras` archive's weights file, read in place.

Keras stores the members of a `.keras` archive uncompressed, so the bytes
of `model.weights.h5` lie in the archive as they would on disk. On the
Python versions that Keras supports, a member opened with `ZipFile.open`
seeks by reading: a jump back starts again from the member's first byte,
a jump forward reads every byte in between. HDF5 jumps between its
metadata and its datasets, so upstream copies the member into memory or
onto the disk before reading it. `open_stored_member` instead gives a
file over the member's own bytes in the archive, which seeks for free:
h5py then reads only what it asks for (the metadata, and the blocks that
a process loads).
"""

import io
import os
import struct
import zipfile

# A zip local file header: its fixed part, and where in it the lengths of
# the file name and of the extra field are (APPNOTE.TXT, 4.3.7).
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"
_NAME_LENGTH = 10
_EXTRA_LENGTH = 11


def open_stored_member(archive, name):
    """A read-only, seekable file over an uncompressed member of `archive`.

    Args:
        archive: a `zipfile.ZipFile` opened for reading.
        name: the member's name.

    Returns:
        A binary file object, or `None` where the member cannot be read in
        place: it is compressed or encrypted, or the archive is not a file
        on the local disk.
    """
    info = archive.getinfo(name)
    path = archive.filename
    if (
        info.compress_type != zipfile.ZIP_STORED
        or info.flag_bits & 0x1
        or not isinstance(path, str)
        or not os.path.isfile(path)
    ):
        return None
    raw = open(path, "rb", buffering=0)
    try:
        start = _data_start(raw, info)
    except Exception:
        raw.close()
        raise
    # Unbuffered: h5py asks for the bytes it needs, no more is read.
    return _MemberFile(raw, start, info.file_size)


def _data_start(raw, info):
    """Where the member's bytes start: after its local header."""
    raw.seek(info.header_offset)
    header = raw.read(_LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_HEADER_SIGNATURE:
        raise ValueError(
            f"Bad zip local header for member '{info.filename}' at offset "
            f"{info.header_offset}."
        )
    return (
        info.header_offset
        + _LOCAL_HEADER.size
        + fields[_NAME_LENGTH]
        + fields[_EXTRA_LENGTH]
    )


class _MemberFile(io.RawIOBase):
    """The bytes `[start, start + size)` of a raw file, as a file."""

    def __init__(self, raw, start, size):
        super().__init__()
        self._raw = raw
        self._start = start
        self._size = size
        self._position = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._position

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position}.get(
            whence, self._size
        )
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer):
        count = max(0, min(len(buffer), self._size - self._position))
        if count == 0:
            return 0
        self._raw.seek(self._start + self._position)
        read = self._raw.readinto(memoryview(buffer)[:count])
        self._position += read
        return read

    def close(self):
        if not self.closed:
            self._raw.close()
        super().close()


def load_model_in_place(fileobj, custom_objects, compile, safe_mode):
    """Loads a `.keras` archive with its weights file read in place.

    As `saving_lib._load_model_from_fileobj`, whose weights store is an
    `H5IOStore` over the archive's member (opened by `open_stored_member`
    where it can be), never a copy of the member in memory or on disk.
    """
    from keras.src.saving import saving_lib as lib

    with zipfile.ZipFile(fileobj, "r") as archive:
        config = lib._safe_zip_read(archive, lib._CONFIG_FILENAME)
        model = lib._model_from_config(
            config, custom_objects, compile, safe_mode
        )
        names = archive.namelist()
        if lib._VARS_FNAME_H5 in names:
            lib._reject_zip_bomb(archive, lib._VARS_FNAME_H5)
            weights = lib.H5IOStore(lib._VARS_FNAME_H5, archive, mode="r")
        elif lib._VARS_FNAME_NPZ in names:
            weights = lib.NpzIOStore(lib._VARS_FNAME_NPZ, archive, mode="r")
        else:
            raise ValueError(
                f"Expected a {lib._VARS_FNAME_H5} or {lib._VARS_FNAME_NPZ} "
                "file."
            )
        # Upstream's test for assets: more members than the three files.
        assets = None
        if len(names) > 3:
            assets = lib.DiskIOStore(
                lib._ASSETS_DIRNAME, archive=archive, mode="r"
            )
        failed, messages = set(), {}
        try:
            lib._load_state(
                model,
                weights_store=weights,
                assets_store=assets,
                inner_path="",
                visited_saveables=set(),
                failed_saveables=failed,
                error_msgs=messages,
            )
        finally:
            weights.close()
            if assets is not None:
                assets.close()
    if failed:
        lib._raise_loading_failure(messages)
    return model
