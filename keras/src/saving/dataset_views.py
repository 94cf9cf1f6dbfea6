"""HDF5 datasets handed out unread, so that a sharded variable reads its part.

Under a distribution, a Keras weights store hands out a `DatasetView` for
each saved array instead of the array itself. The view knows the array's
shape and dtype and reads any block of it on demand (h5py reads a
hyperslab: only that block comes off the disk). A backend that lays a
variable out in shards reads, on each process, only the blocks that
process holds (`read_blocks`); any other reader converts the view with
`numpy.asarray` and gets the whole array, as upstream's store gives it.

A view may outlive the file handle it came from: a sharded weights store
closes a shard file once it has looked a key up in it. The view then opens
its file again, by name, for the read.

Files read by blocks are opened with `open_for_blocks`, without HDF5's
data sieve buffer: through it, a block of columns is read in pieces of 64
KiB around each of its rows, which reads the whole array where its rows
are short.
"""

import os

import ml_dtypes
import numpy as np

from keras.src.utils.module_utils import h5py


def open_for_blocks(path):
    """Opens the HDF5 file `path` for reading blocks, without a sieve
    buffer: each row of a block is read as it is, and only it."""
    properties = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    properties.set_sieve_buf_size(0)
    file_id = h5py.h5f.open(
        os.fsencode(path), h5py.h5f.ACC_RDONLY, fapl=properties
    )
    return h5py.File(file_id)


class DatasetView:
    """A saved array, read on demand.

    Args:
        dataset: the `h5py.Dataset`.
    """

    def __init__(self, dataset):
        self._dataset = dataset
        self._dataset_path = dataset.name
        self._filename = dataset.file.filename
        self.shape = tuple(dataset.shape)
        # Keras saves bfloat16 arrays with their dtype named in an attribute.
        self._bfloat16 = dataset.attrs.get("dtype") == "bfloat16"
        self.dtype = (
            np.dtype(ml_dtypes.bfloat16) if self._bfloat16 else dataset.dtype
        )

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __len__(self):
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        value = self[()]
        return value if dtype is None else value.astype(dtype)

    def __getitem__(self, selection):
        """Reads `selection` (slices or integers) from the file."""
        if self._dataset.id.valid:
            return self._converted(self._dataset[selection])
        if not os.path.isfile(self._filename):
            raise ValueError(
                f"The weights file of '{self._dataset_path}' was closed "
                "before the array was read, and it cannot be opened again by "
                "name "
                f"({self._filename!r})."
            )
        with open_for_blocks(self._filename) as f:
            return self._converted(f[self._dataset_path][selection])

    def read_blocks(self, blocks):
        """Reads blocks of the array, each given as a tuple of slices.

        The file is opened (again) at most once for all of them.

        Args:
            blocks: a list of tuples of `slice`s, one slice per dimension.

        Returns:
            A list of numpy arrays, one per block.
        """
        if self._dataset.id.valid:
            return [self._read(self._dataset, block) for block in blocks]
        with open_for_blocks(self._filename) as f:
            dataset = f[self._dataset_path]
            return [self._read(dataset, block) for block in blocks]

    def _read(self, dataset, block):
        shape = tuple(s.stop - s.start for s in block)
        if 0 in shape:
            # h5py refuses empty selections of some shapes; nothing to read.
            return np.empty(shape, dtype=self.dtype)
        return self._converted(dataset[block])

    def _converted(self, value):
        value = np.asarray(value)
        if not self._bfloat16 or value.dtype == self.dtype:
            return value
        if value.dtype.kind == "V":
            # h5py stores bfloat16 as opaque 2-byte values: the same bits.
            return value.view(self.dtype)
        return value.astype(self.dtype)

    def __repr__(self):
        return (
            f"<DatasetView {self._dataset_path} shape={self.shape} "
            f"dtype={self.dtype}>"
        )
