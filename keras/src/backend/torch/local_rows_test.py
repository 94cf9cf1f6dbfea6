"""Tests of `local_rows` on a one-process mesh."""

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import ops
from keras.src import testing
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_rows
from keras.src.distribution import distribution_lib as distribution_api


class ConvolutionTest(testing.TestCase):
    """Convolutions take their weight and bias whole, and their input
    split along the batch at most."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        mesh = self.mesh.backend_mesh
        rng = np.random.default_rng(0)
        self.x = torch.as_tensor(
            rng.normal(size=(2, 4, 6, 6)), dtype=torch.float32
        )
        self.w = torch.as_tensor(
            rng.normal(size=(8, 4, 3, 3)), dtype=torch.float32
        )
        self.b = torch.as_tensor(rng.normal(size=(8,)), dtype=torch.float32)
        # Input split along its batch and channels, weight and bias along
        # their output channels (on one-process axes, where the local
        # shards are whole, so the values can be compared).
        self.inputs = (
            distribute_tensor(self.x, mesh, [Shard(0), Shard(1)]),
            distribute_tensor(self.w, mesh, [Replicate(), Shard(0)]),
            distribute_tensor(self.b, mesh, [Replicate(), Shard(0)]),
        )

    def test_each_process_convolves_its_rows(self):
        seen = []

        def convolution(x, weight, bias=None, **kwargs):
            seen.append([(type(t), tuple(t.shape)) for t in (x, weight, bias)])
            return torch.conv2d(x, weight, bias, **kwargs)

        handler = local_rows.HANDLERS[torch.conv2d]
        with created_tensors.replicate_created_tensors(self.mesh):
            mode = created_tensors.current_mode()
            out = handler(mode, convolution, self.inputs, {"padding": 1})
            by_keywords = handler(
                mode,
                convolution,
                self.inputs[:1],
                {"weight": self.inputs[1], "bias": self.inputs[2]},
            )
        # Plain local tensors: this process's rows, the weight and bias
        # whole (gathered from their split over "model").
        local = [
            (torch.Tensor, (2, 4, 6, 6)),
            (torch.Tensor, (8, 4, 3, 3)),
            (torch.Tensor, (8,)),
        ]
        self.assertEqual(seen, [local] * 2)
        self.assertEqual(out.placements, (Shard(0), Replicate()))
        self.assertAllClose(
            out.full_tensor().numpy(),
            torch.conv2d(self.x, self.w, self.b, padding=1).numpy(),
            atol=1e-5,
        )
        self.assertEqual(tuple(by_keywords.shape), (2, 8, 4, 4))

    def test_a_valid_convolution_torch_2_11_refused(self):
        """Torch 2.11's DTensor convolution refused a 3 x 3 "valid"
        convolution of a batch split along its rows."""
        x = distribute_tensor(
            self.x, self.mesh.backend_mesh, [Shard(0), Replicate()]
        )
        with created_tensors.replicate_created_tensors(self.mesh):
            out = torch.nn.functional.conv2d(x, self.inputs[1], self.inputs[2])
        self.assertEqual(out.placements, (Shard(0), Replicate()))
        self.assertAllClose(
            out.full_tensor().numpy(),
            torch.conv2d(self.x, self.w, self.b).numpy(),
            atol=1e-5,
        )

    def test_every_convolution_has_the_handler(self):
        for func in (
            torch.nn.functional.conv1d,
            torch.nn.functional.conv2d,
            torch.nn.functional.conv3d,
            torch.nn.functional.conv_transpose1d,
            torch.nn.functional.conv_transpose2d,
            torch.nn.functional.conv_transpose3d,
        ):
            self.assertIs(
                created_tensors._HANDLERS[func], local_rows._convolution
            )

    def test_gradients_go_back_to_the_shards(self):
        x, w, b = (t.detach().requires_grad_() for t in self.inputs)
        with created_tensors.replicate_created_tensors(self.mesh):
            out = torch.nn.functional.conv2d(x, w, b, padding=1)
        (out.full_tensor() ** 2).sum().backward()
        plain = [t.clone().requires_grad_() for t in (self.x, self.w, self.b)]
        (torch.conv2d(*plain, padding=1) ** 2).sum().backward()
        for got, expected in zip((x, w, b), plain):
            self.assertAllClose(
                got.grad.full_tensor().numpy(), expected.grad.numpy(), atol=1e-4
            )

    def test_weight_gradients_are_partial_sums_over_the_batch_split(self):
        """Each process's gradient of the (replicated) weight and bias is
        its rows' part: a partial sum over the axis that splits the
        batch, a whole one over the other."""
        mesh = self.mesh.backend_mesh
        x = distribute_tensor(self.x, mesh, [Shard(0), Replicate()])
        w, b = (
            distribute_tensor(t, mesh, [Replicate(), Replicate()])
            .detach()
            .requires_grad_()
            for t in (self.w, self.b)
        )
        with created_tensors.replicate_created_tensors(self.mesh):
            out = torch.nn.functional.conv2d(x, w, b)
        (out.full_tensor() ** 2).sum().backward()
        for got in (w, b):
            self.assertEqual(got.grad.placements, (Partial(), Replicate()))


class LocalRowsTest(testing.TestCase):
    """`stft`, `istft`, `unfold` and the cumulative ops run on each
    process's rows."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        rng = np.random.default_rng(0)
        self.signals = rng.normal(size=(4, 64)).astype("float32")

    def distributed(self, value, placements):
        tensor = torch.from_numpy(value).requires_grad_()
        return distribute_tensor(tensor, self.mesh.backend_mesh, placements)

    def test_stft_keeps_the_batch_split_and_gathers_the_rest(self):
        # The signal is split along its samples too, on a one-process
        # axis, where the values can be compared.
        signals = self.distributed(self.signals, [Shard(0), Shard(1)])
        with created_tensors.replicate_created_tensors(self.mesh):
            real, imag = ops.stft(signals, 16, 8, 16)
        plain = torch.from_numpy(self.signals).requires_grad_()
        expected_real, expected_imag = ops.stft(plain, 16, 8, 16)
        for got, expected in ((real, expected_real), (imag, expected_imag)):
            self.assertIsInstance(got, DTensor)
            self.assertEqual(got.placements, (Shard(0), Replicate()))
            self.assertEqual(got.shape, expected.shape)
            self.assertAllClose(
                got.full_tensor().detach().numpy(),
                expected.detach().numpy(),
                atol=1e-5,
            )
        ((real**2).sum() + (imag**2).sum()).full_tensor().backward()
        ((expected_real**2).sum() + (expected_imag**2).sum()).backward()
        self.assertAllClose(
            signals.grad.full_tensor().numpy(), plain.grad.numpy(), atol=1e-4
        )

    def test_istft_inverts_stft_on_the_split_batch(self):
        signals = self.distributed(self.signals, [Shard(0), Replicate()])
        with created_tensors.replicate_created_tensors(self.mesh):
            spectrum = ops.stft(signals, 16, 4, 16)
            restored = ops.istft(spectrum, 16, 4, 16, length=64)
        self.assertEqual(restored.placements, (Shard(0), Replicate()))
        self.assertAllClose(
            restored.full_tensor().detach().numpy(), self.signals, atol=1e-5
        )

    def test_one_signal_is_transformed_whole(self):
        signal = self.distributed(self.signals[0], [Shard(0), Replicate()])
        with created_tensors.replicate_created_tensors(self.mesh):
            real, _ = ops.stft(signal, 16, 8, 16)
        expected, _ = ops.stft(torch.from_numpy(self.signals[0]), 16, 8, 16)
        self.assertEqual(real.placements, (Replicate(), Replicate()))
        self.assertAllClose(
            real.full_tensor().detach().numpy(), expected.numpy(), atol=1e-5
        )

    def test_a_plain_window_is_left_to_dtensor(self):
        # A plain tensor may hold a process's own values: the call is not
        # taken for one that runs on every process alike.
        signals = self.distributed(self.signals, [Shard(0), Replicate()])
        window = torch.hann_window(16)
        with created_tensors.replicate_created_tensors(self.mesh):
            replicated_window = torch.hann_window(16)
            with self.assertRaisesRegex(RuntimeError, "DTensor"):
                torch.stft(signals, 16, 8, window=window, return_complex=True)
        self.assertEqual(replicated_window.placements, (Replicate(),) * 2)

    def check_along_one_dimension(self, op, value, dim, placements_list):
        """`op` of `value`, laid out as each of `placements_list`: the
        dimension `dim` it runs along is gathered, the others keep their
        split, and the values and gradients are those of plain tensors."""
        plain = torch.tensor(value, requires_grad=True)
        expected = op(plain)
        (expected**2).sum().backward()
        for placements in placements_list:
            with self.subTest(placements=placements):
                x = self.distributed(value, placements)
                with created_tensors.replicate_created_tensors(self.mesh):
                    result = op(x)
                kept = [
                    p if p.is_shard() and p.dim != dim else Replicate()
                    for p in placements
                ]
                self.assertEqual(list(result.placements), kept)
                self.assertAllClose(
                    result.full_tensor().detach().numpy(),
                    expected.detach().numpy(),
                    atol=1e-5,
                )
                (result.full_tensor() ** 2).sum().backward()
                self.assertAllClose(
                    x.grad.full_tensor().numpy(), plain.grad.numpy(), atol=1e-4
                )

    def test_unfold_keeps_other_dimensions_split(self):
        # `ops.extract_sequences` frames the last dimension with `unfold`.
        value = np.random.default_rng(0).standard_normal((4, 3, 10))
        self.check_along_one_dimension(
            lambda x: ops.extract_sequences(x, 4, 3),
            value.astype("float32"),
            2,
            (
                [Shard(0), Shard(1)],
                [Shard(1), Replicate()],
                [Replicate(), Shard(2)],
            ),
        )

    def test_cumulative_ops_and_gradients_run_on_local_rows(self):
        value = np.random.default_rng(1).uniform(0.5, 1.5, size=(4, 6))
        for op in (ops.cumprod, ops.cumsum):
            with self.subTest(op=op.__name__):
                self.check_along_one_dimension(
                    lambda x: op(x, axis=-1),
                    value.astype("float32"),
                    1,
                    ([Shard(0), Shard(1)], [Replicate(), Shard(0)]),
                )
