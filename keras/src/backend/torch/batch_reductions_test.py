"""Tests of `batch_reductions` on a one-process mesh.

A batch axis of one process holds the whole batch: the local reduction
needs no collective there, and gives the DTensor reduction's value,
gradient and placements. Across processes the same comparison runs in the
integration tests.
"""

import threading
from unittest import mock

import numpy as np
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras.src import losses
from keras.src import testing
from keras.src.backend.torch import batch_local
from keras.src.backend.torch import batch_reductions
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import torch_internals
from keras.src.distribution import distribution_lib as distribution_api
from keras.src.losses import loss as loss_module


class OneProcessBatchAxisTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        distribution_api.set_distribution(
            distribution_api.DataParallel(device_mesh=self.mesh)
        )
        self.addCleanup(distribution_api.set_distribution, None)
        rng = np.random.default_rng(0)
        self.values = rng.normal(size=(6, 3)).astype("float32")
        self.weights = rng.uniform(size=(6, 3)).astype("float32")

    def split(self, array, requires_grad=False):
        tensor = distribute_tensor(
            torch.tensor(array), self.mesh.backend_mesh, [Shard(0)]
        )
        return tensor.requires_grad_(requires_grad)

    def reduce(self, reduction, local, weighted=False):
        """The reduction's value, gradient, placements and collectives.

        Args:
            reduction: the loss reduction.
            local: whether the local plan may be taken (False: upstream's
                reduction on DTensors).
            weighted: whether sample weights split like the values are
                given.
        """
        values = self.split(self.values, requires_grad=True)
        weight = self.split(self.weights) if weighted else None
        plan = mock.patch.object(
            batch_reductions,
            "_local_plan",
            wraps=batch_reductions._local_plan,
            **({} if local else {"return_value": None}),
        )
        collective = mock.patch.object(
            torch.distributed, "all_reduce", wraps=torch.distributed.all_reduce
        )
        read = mock.patch.object(
            DTensor, "to_local", autospec=True, side_effect=DTensor.to_local
        )
        with plan, collective as all_reduce, read as to_local:
            with created_tensors.replicate_created_tensors(self.mesh):
                value = loss_module.reduce_weighted_values(
                    values, sample_weight=weight, reduction=reduction
                )
            value.backward()
        return {
            "value": value.full_tensor().detach().numpy(),
            "grad": values.grad.full_tensor().numpy(),
            "placements": tuple(value.placements),
            "all_reduce": all_reduce.call_count,
            # The local plan reads the values' local tensor.
            "local": any(c.args[0] is values for c in to_local.mock_calls),
        }

    def test_local_reduction_matches_the_dtensor_one(self):
        for reduction in ("sum", "sum_over_batch_size", "mean"):
            for weighted in (False, True):
                with self.subTest(reduction=reduction, weighted=weighted):
                    local = self.reduce(reduction, True, weighted)
                    upstream = self.reduce(reduction, False, weighted)
                    self.assertTrue(local["local"])
                    self.assertFalse(upstream["local"])
                    self.assertEqual(local["all_reduce"], 0)
                    self.assertEqual(
                        local["placements"], upstream["placements"]
                    )
                    np.testing.assert_array_equal(
                        local["value"], upstream["value"]
                    )
                    np.testing.assert_array_equal(
                        local["grad"], upstream["grad"]
                    )

    def test_mean_reduced_with_gradients_is_left_partial(self):
        # As if the batch axis had 2 processes: the plan reduces over it.
        plan = mock.patch.object(
            batch_reductions, "_local_plan", return_value=(2, (0,), (0,))
        )
        collective = mock.patch.object(
            torch.distributed, "all_reduce", wraps=torch.distributed.all_reduce
        )
        values = self.split(self.values, requires_grad=True)
        with plan, collective as all_reduce:
            with created_tensors.replicate_created_tensors(self.mesh):
                with batch_reductions.means_reduced_with_gradients():
                    value = loss_module.reduce_weighted_values(
                        values, reduction="sum_over_batch_size"
                    )
            (value * 3.0).backward()
        self.assertEqual(all_reduce.call_count, 0)
        self.assertEqual(tuple(value.placements), (Partial("avg"),))
        # This process's local mean, and the gradient of the mean over 2
        # processes' values: each local value's 1 / (2 * its count).
        np.testing.assert_allclose(
            value.to_local().detach().numpy(), self.values.mean(), rtol=1e-6
        )
        np.testing.assert_allclose(
            values.grad.full_tensor().numpy(),
            np.full(self.values.shape, 3.0 / self.values.size / 2),
            rtol=1e-6,
        )
        # Outside the block, a mean is reduced where it is computed.
        values = self.split(self.values)
        with plan:
            with created_tensors.replicate_created_tensors(self.mesh):
                value = loss_module.reduce_weighted_values(
                    values, reduction="sum_over_batch_size"
                )
        self.assertEqual(tuple(value.placements), (Replicate(),))

    def test_the_step_flags_are_per_thread(self):
        seen = []

        def read_flags():
            step = batch_reductions._STEP
            seen.append((step.with_gradients, step.noted_plans))

        with batch_reductions.means_reduced_with_gradients():
            self.assertTrue(batch_reductions._STEP.with_gradients)
            worker = threading.Thread(target=read_flags)
            worker.start()
            worker.join()
        self.assertEqual(seen, [(False, None)])
        self.assertFalse(batch_reductions._STEP.with_gradients)

    def test_whole_value_reduces_partial_values_only(self):
        mesh = self.mesh.backend_mesh
        for reduce_op in ("sum", "avg"):
            with self.subTest(reduce_op):
                partial = DTensor.from_local(
                    torch.tensor(2.5), mesh, [Partial(reduce_op)]
                )
                whole = batch_reductions.whole_value(partial)
                self.assertEqual(tuple(whole.placements), (Replicate(),))
                # Over one process the value is this process's.
                self.assertEqual(whole.to_local().item(), 2.5)
        replicated = distribute_tensor(torch.tensor(2.5), mesh, [Replicate()])
        maximum = DTensor.from_local(torch.tensor(2.5), mesh, [Partial("max")])
        plain = torch.tensor(2.5)
        for value in (replicated, maximum, plain, None, 3):
            self.assertIs(batch_reductions.whole_value(value), value)

    def test_plan_names_no_mesh_dim_to_reduce(self):
        values = self.split(self.values)
        with created_tensors.replicate_created_tensors(self.mesh):
            plan = batch_reductions._local_plan(values, None, None, "mean")
        self.assertEqual(plan, (1, (0,), ()))

    def call_loss_three_times(self, loss, weighted=False, mask=False):
        """Per call of `loss` in a step: its value, the gradient of the
        predictions, the value's placements, whether the per-sample values
        went through `batch_local.call_layer`, and whether the reduction
        met per-sample values that are DTensors."""
        labels = self.split(np.arange(6) % 3)
        logits = self.split(self.values, requires_grad=True)
        weight = self.split(self.weights[:, 0]) if weighted else None
        if mask:
            logits._keras_mask = self.split(np.ones(6, dtype=bool))
        results = []
        for _ in range(3):
            logits.grad = None
            call_layer = mock.patch.object(
                batch_local, "call_layer", wraps=batch_local.call_layer
            )
            reduce = mock.patch.object(
                batch_reductions,
                "reduce_on_local_tensors",
                wraps=batch_reductions.reduce_on_local_tensors,
            )
            with call_layer as per_sample, reduce as reduction:
                with created_tensors.replicate_created_tensors(self.mesh):
                    value = loss(labels, logits, sample_weight=weight)
            value.backward()
            results.append(
                {
                    "value": value.full_tensor().detach().numpy(),
                    "grad": logits.grad.full_tensor().numpy(),
                    "placements": tuple(value.placements),
                    "per_sample_call": per_sample.called,
                    "reduction": any(
                        type(c.args[1]) is DTensor
                        for c in reduction.call_args_list
                    ),
                }
            )
        return results

    def test_loss_runs_whole_on_local_tensors_from_its_third_call(self):
        for reduction in ("sum_over_batch_size", "sum"):
            for weighted in (False, True):
                with self.subTest(reduction=reduction, weighted=weighted):
                    loss = losses.SparseCategoricalCrossentropy(
                        from_logits=True, reduction=reduction
                    )
                    results = self.call_loss_three_times(loss, weighted)
                    # Watched, local per-sample values, then the whole
                    # loss on local tensors.
                    self.assertEqual(
                        [r["per_sample_call"] for r in results],
                        [True, True, False],
                    )
                    self.assertEqual(
                        [r["reduction"] for r in results],
                        [True, True, False],
                    )
                    (plan,) = batch_reductions._LOSS_PLANS.of(loss).values()
                    self.assertEqual(
                        (plan.reduction, plan.shards, plan.reduced_dims),
                        (reduction, 1, ()),
                    )
                    for result in results[1:]:
                        self.assertEqual(
                            result["placements"], results[0]["placements"]
                        )
                        np.testing.assert_array_equal(
                            result["value"], results[0]["value"]
                        )
                        np.testing.assert_array_equal(
                            result["grad"], results[0]["grad"]
                        )

    def test_masked_predictions_keep_upstreams_loss_call(self):
        loss = losses.SparseCategoricalCrossentropy(from_logits=True)
        results = self.call_loss_three_times(loss, mask=True)
        self.assertEqual(batch_reductions._LOSS_PLANS.of(loss), {})
        self.assertEqual([r["reduction"] for r in results], [True] * 3)
        for result in results[1:]:
            np.testing.assert_array_equal(result["value"], results[0]["value"])

    def test_unreduced_losses_keep_no_plan(self):
        loss = losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None
        )
        labels = self.split(np.arange(6) % 3)
        logits = self.split(self.values)
        for _ in range(3):
            with created_tensors.replicate_created_tensors(self.mesh):
                value = loss(labels, logits)
            self.assertEqual(tuple(value.shape), (6,))
        self.assertEqual(batch_reductions._LOSS_PLANS.of(loss), {})

    def test_a_loss_with_a_call_of_its_own_keeps_upstreams_loss_call(self):
        class Halved(losses.LossFunctionWrapper):
            def call(self, y_true, y_pred):
                return super().call(y_true, y_pred) / 2

        loss = Halved(losses.sparse_categorical_crossentropy, from_logits=True)
        with mock.patch.object(
            batch_reductions, "call_loss", wraps=batch_reductions.call_loss
        ) as call_loss:
            results = self.call_loss_three_times(loss)
        call_loss.assert_not_called()
        self.assertEqual([r["reduction"] for r in results], [True] * 3)

    def unread_loss(self, value):
        """A replicated scalar DTensor whose local tensor is an
        `AsyncCollectiveTensor` not yet waited for, and that tensor."""
        replicated = distribute_tensor(
            torch.tensor(0.0), self.mesh.backend_mesh, [Replicate()]
        )
        unread = AsyncCollectiveTensor(torch.tensor(value))
        loss = dtensor_layouts.dtensor_from_spec(
            unread,
            dtensor_layouts.copy_spec(torch_internals.spec_of(replicated)),
        )
        return loss, unread

    def test_waited_local_tensor_of_an_unread_loss_is_plain(self):
        loss, unread = self.unread_loss(2.5)
        local = dtensor_layouts.waited_local_tensor(loss)
        self.assertIs(type(local), torch.Tensor)
        self.assertEqual(local.item(), 2.5)
        self.assertTrue(unread.completed)
        # Read again, and for a plain local tensor: the local tensor.
        self.assertIs(dtensor_layouts.waited_local_tensor(loss), unread.elem)
        replicated = distribute_tensor(
            torch.tensor(0.0), self.mesh.backend_mesh, [Replicate()]
        )
        self.assertIs(
            dtensor_layouts.waited_local_tensor(replicated),
            torch_internals.local_tensor(replicated),
        )
