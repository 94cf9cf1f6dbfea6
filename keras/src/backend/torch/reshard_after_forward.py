"""Unsharded variable values of a local call, freed once forward is done.

A local call (`batch_local`) reads each variable sharded over the batch
axes unsharded (`unit_gathering`). As FSDP's `reshard_after_forward`
does, such a value (but the root unit's, kept for the whole call) is not
kept for backward: `ReshardAfterForward` notes where each unsharded
value lies, and its saved-tensor hooks save what backward needs of one
as a note, unsharded again (one collective per unit and backward pass)
when backward first needs it. Inside a checkpoint the checkpoint frees
them with the rest, and its recomputation unshards again instead.

Contract: only plain contiguous tensors that lie in a registered value
are saved as notes; every other saved tensor is saved as it is. The
gathers again in backward run in autograd's order, the same on every
process for the same program and global shapes.
"""

import contextlib
import weakref

import torch

from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import unit_gathering


class ReshardAfterForward:
    """The unsharded values of one local call, by storage address.

    Attributes:
        storages: the storage address of each unsharded value -> its
            `_UnshardForBackward` and its index there.
    """

    def __init__(self):
        self.storages = {}

    def register(self, plan, values, views):
        """Notes where the unsharded `views` of `values` lie.

        Args:
            plan: the `gathered_units.UnitPlan` that unsharded them, or
                None for one value unsharded by DTensor.
            values: the variables' sharded DTensor values.
            views: their unsharded local views, in the same order.
        """
        source = _UnshardForBackward(plan, values)
        for index, view in enumerate(views):
            if not view.is_contiguous():
                continue
            source.offsets[index] = view.storage_offset()
            storage = view.untyped_storage().data_ptr()
            self.storages[storage] = (source, index)
            # The address may be reused once the view and its storage are
            # freed: by then no saved tensor may be taken for it.
            weakref.finalize(view, self.storages.pop, storage, None)

    def saved_tensors_hooks(self):
        """Saved-tensor hooks that save registered values as notes.

        Autograd saves what backward needs; a saved unsharded value (or a
        view of one) is saved as a note of where it lies in the value,
        and is unsharded again, once per backward pass, when backward
        first needs it. Other tensors are saved as they are.
        """
        storages = self.storages

        def pack(tensor):
            if type(tensor) is not torch.Tensor:
                return tensor
            found = storages.get(tensor.untyped_storage().data_ptr())
            if found is None or tensor.dtype != found[0].dtype:
                return tensor
            return _SavedUnsharded(*found, tensor)

        def unpack(saved):
            if isinstance(saved, _SavedUnsharded):
                return saved.tensor()
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def saved_tensors_hooks(resharding):
    """`resharding`'s hooks, or no hooks where it is None."""
    if resharding is None:
        return contextlib.nullcontext()
    return resharding.saved_tensors_hooks()


class _UnshardForBackward:
    """Unsharded values of a local call, by reference.

    Holds the variables' sharded values, not the unsharded ones, so that
    these are freed once forward no longer uses them. `local(index)`
    unshards them again for backward (one collective per unit and
    backward pass), once for every saved use.
    """

    def __init__(self, plan, values):
        self.plan = plan
        self.values = values
        self.dtype = values[0].dtype
        # Per unsharded value, its storage offset in forward.
        self.offsets = {}
        self.uses = 0
        self.cache = None

    def local(self, index):
        """An unsharded local tensor, for one saved use in backward."""
        if self.cache is None:
            with torch.no_grad():
                self.cache = self._unshard()
        local = self.cache[index]
        self.uses -= 1
        if self.uses == 0:
            # The last saved use: backward frees it after this node.
            self.cache = None
        return local

    def _unshard(self):
        if self.plan is None:
            local = torch_internals.local_tensor(
                unit_gathering.unshard(self.values[0])
            )
            return [local.contiguous()]
        return self.plan.gather(
            [torch_internals.local_tensor(value) for value in self.values]
        )


class _SavedUnsharded:
    """A saved unsharded value (or a view of one), unsharded again when
    backward unpacks it."""

    def __init__(self, source, index, tensor):
        source.uses += 1
        self.source = source
        self.index = index
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset() - source.offsets[index]

    def tensor(self):
        local = self.source.local(self.index)
        return local.as_strided(
            self.size, self.stride, local.storage_offset() + self.offset
        )
