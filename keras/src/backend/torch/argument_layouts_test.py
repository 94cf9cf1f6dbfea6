"""Tests of `argument_layouts` on a one-process mesh."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import testing
from keras.src.backend.torch import argument_layouts
from keras.src.backend.torch import created_tensors
from keras.src.distribution import distribution_lib as distribution_api


class ContiguousTest(testing.TestCase):
    """`contiguous` keeps DTensors in the standard memory format."""

    def test_dtensors_take_the_standard_format_plain_tensors_any(self):
        mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        images = torch.arange(2 * 3 * 4 * 4.0).reshape(2, 4, 4, 3)
        value = distribute_tensor(images, mesh.backend_mesh, [Shard(0)])
        with created_tensors.replicate_created_tensors(mesh):
            nchw = value.permute(0, 3, 1, 2)
            standard = nchw.contiguous(memory_format=torch.channels_last)
            plain = images.permute(0, 3, 1, 2).contiguous(
                memory_format=torch.channels_last
            )
        self.assertTrue(standard.is_contiguous())
        self.assertTrue(standard.to_local().is_contiguous())
        self.assertEqual(standard.stride(), standard.to_local().stride())
        self.assertAllClose(standard.full_tensor().numpy(), nchw.full_tensor())
        # Plain tensors (local calls) keep the format they ask for.
        self.assertTrue(plain.is_contiguous(memory_format=torch.channels_last))
        self.assertFalse(plain.is_contiguous())


class RepeatsAsIntTest(testing.TestCase):
    """A one-element `repeats` tensor of `repeat_interleave` is an int
    where the input or `repeats` is a DTensor."""

    def test_repeats_tensor_of_a_dtensor_input_becomes_an_int(self):
        mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        value = distribute_tensor(
            torch.arange(3.0), mesh.backend_mesh, [Shard(0)]
        )
        as_int = argument_layouts._repeats_as_int
        args, kwargs = as_int((value, torch.tensor([2])), {"dim": 0})
        self.assertEqual((args[1], kwargs), (2, {"dim": 0}))
        args, kwargs = as_int((value,), {"repeats": torch.tensor(3)})
        self.assertEqual(kwargs, {"repeats": 3})
        # Plain inputs, and repeats of several elements, are left as they
        # are.
        plain = (torch.arange(3.0), torch.tensor([2]))
        self.assertIs(as_int(plain, {})[0], plain)
        several = (value, torch.tensor([1, 2, 3]))
        self.assertIs(as_int(several, {})[0], several)
        with created_tensors.replicate_created_tensors(mesh):
            repeated = torch.repeat_interleave(value, torch.tensor([2]))
        self.assertIsInstance(repeated, DTensor)
        self.assertAllClose(repeated.full_tensor().numpy(), [0, 0, 1, 1, 2, 2])
