"""Tests of `replicate_created_tensors` on a one-process mesh."""

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

import keras
from keras.src import ops
from keras.src import testing
from keras.src.backend.torch import created_tensors
from keras.src.distribution import distribution_lib as distribution_api


class OneProcessMeshTestCase(testing.TestCase):
    """A test case with a one-process ("batch",) mesh."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        self.backend_mesh = self.mesh.backend_mesh


class ReplicateCreatedTensorsTest(OneProcessMeshTestCase):
    """Tensors made from Python values inside a step are replicated."""

    def test_factories_make_replicated_dtensors(self):
        with created_tensors.replicate_created_tensors(self.mesh):
            positions = torch.arange(6)
            constants = torch.as_tensor(np.ones((2, 3), dtype="float32"))
            scalar = torch.tensor(2.0)
            broadcast = torch.broadcast_to(scalar, (2, 3))
            meta = torch.ones(3, device="meta")
        for value in (positions, constants, scalar, broadcast):
            self.assertIsInstance(value, DTensor)
            self.assertEqual(tuple(value.placements), (Replicate(),))
        self.assertAllClose(positions.to_local().numpy(), np.arange(6))
        # A scalar counts too, so what is derived from it alone (as
        # metrics broadcast a missing sample weight) is replicated.
        self.assertAllClose(broadcast.to_local().numpy(), np.full((2, 3), 2))
        # Meta tensors (shape inference) hold no values and stay plain.
        self.assertNotIsInstance(meta, DTensor)

    def test_tensors_made_under_vmap_are_replicated(self):
        """Keras's `vectorized_map` (`torch.vmap`) makes tensors too, as a
        multi-label `AUC` does: `DTensor.from_local`'s autograd function
        cannot run under `vmap`, so a value that needs no gradient is
        wrapped without one."""
        rows = distribute_tensor(
            torch.arange(6.0).reshape(2, 3), self.backend_mesh, [Replicate()]
        )
        labels = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
        scores = [[0.9, 0.2, 0.6], [0.3, 0.7, 0.4], [0.8, 0.1, 0.5]]
        expected = keras.metrics.AUC(multi_label=True, num_labels=3)
        expected.update_state(labels, scores)
        with created_tensors.replicate_created_tensors(self.mesh):
            got = torch.vmap(lambda row: row * torch.tensor(2.0))(rows)
            metric = keras.metrics.AUC(multi_label=True, num_labels=3)
            metric.update_state(torch.tensor(labels), torch.tensor(scores))
            auc = metric.result()
        self.assertEqual(tuple(got.placements), (Replicate(),))
        self.assertAllClose(got.full_tensor().numpy(), [[0, 2, 4], [6, 8, 10]])
        self.assertAllClose(
            auc.full_tensor().numpy(), expected.result().numpy()
        )

    def test_zero_d_dtensor_arguments_count_as_python_values(self):
        # As Keras's pairwise losses build a mask: `ops.eye(ops.size(x))`.
        plain_size = torch.tensor(3)
        with created_tensors.replicate_created_tensors(self.mesh):
            size = torch.prod(torch.as_tensor((3,)))
            eye = torch.eye(size, size, dtype=torch.bool)
            from_plain = torch.eye(plain_size, plain_size)
        self.assertIsInstance(size, DTensor)
        self.assertIsInstance(eye, DTensor)
        self.assertEqual(tuple(eye.placements), (Replicate(),))
        self.assertAllClose(eye.to_local().numpy(), np.eye(3, dtype=bool))
        # A plain tensor may hold a process's own value: the result stays
        # plain.
        self.assertNotIsInstance(from_plain, DTensor)

    def test_tensors_from_tensors_stay_plain(self):
        plain = torch.ones(3)
        with created_tensors.replicate_created_tensors(self.mesh):
            copied = torch.as_tensor(plain)
            doubled = plain * 2
        self.assertNotIsInstance(copied, DTensor)
        self.assertNotIsInstance(doubled, DTensor)

    def test_outside_the_context_nothing_changes(self):
        self.assertNotIsInstance(torch.arange(6), DTensor)

    def test_random_draws_use_the_given_generator(self):
        probabilities = torch.full((4, 6), 0.5)
        expected = torch.bernoulli(
            probabilities, generator=torch.Generator().manual_seed(5)
        )
        with created_tensors.replicate_created_tensors(self.mesh):
            drawn = torch.bernoulli(
                torch.full((4, 6), 0.5),
                generator=torch.Generator().manual_seed(5),
            )
        self.assertIsInstance(drawn, DTensor)
        self.assertAllClose(drawn.to_local().numpy(), expected.numpy())

    def test_dropout_mask_equals_the_plain_one(self):
        x = torch.ones(8, 5)
        torch.manual_seed(3)
        expected = torch.nn.functional.dropout(x, p=0.4, training=True)
        inputs = DTensor.from_local(
            x, self.backend_mesh, [Shard(0)], run_check=False
        )
        torch.manual_seed(3)
        with created_tensors.replicate_created_tensors(self.mesh):
            dropped = torch.nn.functional.dropout(inputs, p=0.4, training=True)
            kept = torch.nn.functional.dropout(inputs, p=0.4, training=False)
        self.assertAllClose(dropped.full_tensor().numpy(), expected.numpy())
        self.assertIs(kept, inputs)

    def test_suspended_takes_the_mode_off_and_puts_it_back(self):
        with created_tensors.replicate_created_tensors(self.mesh):
            mode = created_tensors.current_mode()
            self.assertIsNotNone(mode)
            with created_tensors.suspended():
                self.assertFalse(created_tensors.replicating_created_tensors())
                self.assertIsNone(created_tensors.current_mode())
                plain = torch.arange(3)
            self.assertIs(created_tensors.current_mode(), mode)
            with self.assertRaisesRegex(ValueError, "inside"):
                with created_tensors.suspended():
                    raise ValueError("inside")
            # Back after an error too.
            self.assertIs(created_tensors.current_mode(), mode)
            replicated = torch.arange(3)
        self.assertNotIsInstance(plain, DTensor)
        self.assertIsInstance(replicated, DTensor)
        self.assertIsNone(torch.overrides._get_current_function_mode())


class ReplicateBuiltTensorsTest(OneProcessMeshTestCase):
    """A layer's build replicates the tensors it makes from Python values;
    variables are made as outside it."""

    def test_factories_replicate_and_variables_stay_plain(self):
        with created_tensors.replicate_built_tensors(self.mesh):
            constant = torch.as_tensor(np.ones(3, dtype="float32"))
            self.assertFalse(created_tensors.replicating_created_tensors())
            with created_tensors.creating_variable():
                initial = torch.zeros(3)
            after = torch.arange(3)
        self.assertIsInstance(constant, DTensor)
        self.assertEqual(tuple(constant.placements), (Replicate(),))
        self.assertNotIsInstance(initial, DTensor)
        self.assertIsInstance(after, DTensor)
        self.assertNotIsInstance(torch.arange(3), DTensor)

    def test_inside_a_step_the_steps_mode_stays(self):
        with created_tensors.replicate_created_tensors(self.mesh):
            step_mode = created_tensors.current_mode()
            with created_tensors.replicate_built_tensors(self.mesh):
                self.assertIs(created_tensors.current_mode(), step_mode)
                with created_tensors.creating_variable():
                    # Variables made inside a step keep the step's mode.
                    self.assertIs(created_tensors.current_mode(), step_mode)


class CompiledModeTest(OneProcessMeshTestCase):
    """The mode around a compiled step lets Dynamo trace DTensor code."""

    def test_dtensor_code_compiles_into_one_graph(self):
        inputs = DTensor.from_local(
            torch.arange(12.0).reshape(4, 3),
            self.backend_mesh,
            [Shard(0)],
            run_check=False,
        )

        def step(x):
            # Each result is a DTensor the mode looks at.
            return (x * 2.0 + 1.0).sum(dim=1)

        with created_tensors.replicate_created_tensors(self.mesh):
            expected = step(inputs)
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        with created_tensors.replicate_created_tensors(
            self.mesh, compiled=True
        ):
            value = compiled(inputs)
        torch._dynamo.reset()
        self.assertEqual(tuple(value.placements), (Shard(0),))
        self.assertAllClose(
            value.full_tensor().numpy(), expected.full_tensor().numpy()
        )

    def test_lookup_results_are_reduced_as_in_the_eager_mode(self):
        table = DTensor.from_local(
            torch.arange(20.0).reshape(5, 4),
            self.backend_mesh,
            [Shard(0)],
            run_check=False,
        )
        ids = DTensor.from_local(
            torch.tensor([[0, 4], [2, 2]]),
            self.backend_mesh,
            [Replicate()],
            run_check=False,
        )
        results = []
        for compiled in (False, True):
            with created_tensors.replicate_created_tensors(
                self.mesh, compiled=compiled
            ):
                results.append(torch.nn.functional.embedding(ids, table))
        for result in results:
            self.assertEqual(tuple(result.placements), (Replicate(),))
            self.assertAllClose(
                result.full_tensor().numpy(),
                torch.arange(20.0).reshape(5, 4)[ids.to_local()].numpy(),
            )


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

        handler = created_tensors._HANDLERS[torch.conv2d]
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
                created_tensors._HANDLERS[func], created_tensors._convolution
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


class LookupGradientTest(testing.TestCase):
    """Where a reduced lookup's gradient goes back to the lookup."""

    def test_gradient_placements(self):
        from torch.distributed.tensor.placement_types import _MaskPartial

        masked = _MaskPartial(offset_shape=torch.Size([256, 32]), offset_dim=0)
        place = created_tensors._lookup_gradient_placement
        cases = [
            # A masked lookup takes its whole gradient, partial sum or not;
            # DTensor would ask torch 2.11 for a partial-to-masked move.
            (Partial(), masked, Replicate()),
            (Replicate(), masked, Replicate()),
            (Shard(0), masked, Replicate()),
            # Elsewhere, as DTensor's backward redistribution.
            (Partial(), Partial(), Partial()),
            (Replicate(), Partial(), Replicate()),
            (Shard(1), Shard(0), Shard(0)),
            (Partial(), Replicate(), Replicate()),
        ]
        for current, target, expected in cases:
            self.assertEqual(place(current, target), expected)
