"""`local_layouts` in one process: the recorded layout of a local tensor,
and the `cat` handler installed only inside the context.

The 2-process case (Gemma's rotary gradients with one key/value head) is
`integration_tests/step_handlers_test.py`.
"""

import types

import torch
from torch.distributed.tensor import DTensor

from keras.src.backend.torch import local_layouts

_CAT = torch.ops.aten.cat.default


def spec_with_strides(shape, strides):
    meta = types.SimpleNamespace(shape=shape, stride=strides)
    return types.SimpleNamespace(tensor_meta=meta)


def test_recorded_local_strides_follow_the_global_order():
    # Contiguous globally: dense row-major for the local shape, whatever
    # the size-1 dimension's global stride.
    assert local_layouts.recorded_local_strides(
        (2, 8, 1, 8), (64, 8, 8, 1)
    ) == (
        64,
        8,
        8,
        1,
    )
    # Channels-last globally (dimension 1 fastest).
    assert local_layouts.recorded_local_strides(
        (2, 3, 4, 5), (60, 1, 15, 3)
    ) == (
        60,
        1,
        15,
        3,
    )


def test_a_local_tensor_in_another_layout_is_copied_into_the_recorded_one():
    # Gemma's case: a `cat` of (2, 8, 1, 4) gradients gave a channels-last
    # local result, where DTensor records (4, 8, 1, 8) contiguous.
    local = torch.arange(128.0).reshape(2, 8, 1, 8)
    channels_last = local.contiguous(memory_format=torch.channels_last)
    assert not channels_last.is_contiguous()
    spec = spec_with_strides((4, 8, 1, 8), (64, 8, 8, 1))
    fixed = local_layouts.in_recorded_layout(channels_last, spec)
    assert fixed.is_contiguous()
    assert torch.equal(fixed, local)
    fixed.view(2, 8, 8)  # The view that failed on the local tensor.


def test_a_local_tensor_in_the_recorded_layout_is_kept():
    # Strides of size-1 dimensions differ, the layout does not.
    local = torch.zeros(2, 8, 1, 8).as_strided((2, 8, 1, 8), (64, 8, 64, 1))
    spec = spec_with_strides((4, 8, 1, 8), (64, 8, 8, 1))
    assert local_layouts.in_recorded_layout(local, spec) is local


def test_the_cat_handler_is_installed_only_inside_the_context():
    handlers = DTensor._op_dispatcher._custom_op_handlers
    assert _CAT not in handlers
    with local_layouts.recorded_local_layouts():
        handler = handlers[_CAT]
        with local_layouts.recorded_local_layouts():
            assert handlers[_CAT] is handler
        assert handlers[_CAT] is handler
    assert _CAT not in handlers


def test_a_cat_handler_of_the_process_is_kept():
    handlers = DTensor._op_dispatcher._custom_op_handlers

    def own(op_call, args, kwargs):
        return None

    handlers[_CAT] = own
    try:
        with local_layouts.recorded_local_layouts():
            assert handlers[_CAT] is own
        assert handlers[_CAT] is own
    finally:
        handlers.pop(_CAT)
