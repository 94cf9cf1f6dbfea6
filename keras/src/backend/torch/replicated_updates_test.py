"""Tests of `replicated_updates` on a one-process mesh."""

from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src import backend
from keras.src import optimizers
from keras.src import testing
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import replicated_updates
from keras.src.distribution import distribution_lib as distribution_api

# Each optimizer with the options that add work to its step: momentum,
# weight decay, clipping, a moving average, gradient accumulation.
OPTIMIZERS = {
    "sgd": lambda: optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optimizers.Adam(0.01, amsgrad=True, clipnorm=0.5),
    "adamw": lambda: optimizers.AdamW(0.01, weight_decay=0.1, use_ema=True),
    "nadam": lambda: optimizers.Nadam(0.01),
    "rmsprop": lambda: optimizers.RMSprop(
        0.01, momentum=0.5, gradient_accumulation_steps=2
    ),
    "lion": lambda: optimizers.Lion(0.01),
}


def _initial_values():
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=(4, 3)).astype("float32"),
        rng.normal(size=(3,)).astype("float32"),
    ]


def _gradients(step):
    rng = np.random.default_rng(step + 1)
    return [
        rng.normal(size=(4, 3)).astype("float32"),
        rng.normal(size=(3,)).astype("float32"),
    ]


class _OneProcessDataParallelTest(testing.TestCase):
    """Runs each test under `DataParallel` on a one-process mesh."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        distribution_api.set_distribution(
            distribution_api.DataParallel(device_mesh=self.mesh)
        )
        self.addCleanup(distribution_api.set_distribution, None)

    def pretend_mesh_axes_of_several_processes(self):
        """Reads the mesh's axes as holding 2 processes each, in this test,
        so that a split over the one-process mesh leaves a part of a
        value in each process, as it would across processes."""
        patcher = mock.patch.object(
            replicated_updates, "_mesh_dim_size", lambda mesh, dim: 2
        )
        patcher.start()
        self.addCleanup(patcher.stop)

    def replicated(self, value, placements=None):
        """`value` as a DTensor on the mesh, replicated by default."""
        return DTensor.from_local(
            torch.as_tensor(value),
            self.mesh.backend_mesh,
            placements or [Replicate()],
            run_check=False,
        )


class ApplyOnLocalTensorsTest(_OneProcessDataParallelTest):
    """Replicated optimizer steps run on local tensors, with equal values."""

    def train(self, make_optimizer, steps=3, in_step=False):
        """Variables and optimizer variables after `steps` updates."""
        variables = [backend.Variable(v) for v in _initial_values()]
        optimizer = make_optimizer()
        for step in range(steps):
            grads = _gradients(step)
            if isinstance(variables[0].value, DTensor):
                grads = [self.replicated(g) for g in grads]
            else:
                grads = [torch.as_tensor(g) for g in grads]
            if in_step:
                with created_tensors.replicate_created_tensors(self.mesh):
                    optimizer.apply(grads, variables)
            else:
                optimizer.apply(grads, variables)
        return variables, optimizer

    def values(self, variables):
        values = []
        for variable in variables:
            value = variable.value
            if isinstance(value, DTensor):
                self.assertEqual(tuple(value.placements), (Replicate(),))
                value = value.to_local()
            values.append(value.detach().numpy().copy())
        return values

    def test_values_equal_dtensor_and_plain_steps(self):
        for name, make_optimizer in OPTIMIZERS.items():
            with self.subTest(name):
                local_vars, local_opt = self.train(make_optimizer)
                local_in_step, _ = self.train(make_optimizer, in_step=True)
                with mock.patch.object(
                    replicated_updates, "held_values", return_value=None
                ):
                    dtensor_vars, dtensor_opt = self.train(make_optimizer)
                distribution_api.set_distribution(None)
                try:
                    plain_vars, plain_opt = self.train(make_optimizer)
                finally:
                    distribution_api.set_distribution(
                        distribution_api.DataParallel(device_mesh=self.mesh)
                    )
                self.assertIsInstance(local_vars[0].value, DTensor)
                self.assertNotIsInstance(plain_vars[0].value, DTensor)
                local = self.values(local_vars + local_opt.variables)
                in_step = self.values(local_in_step)
                dtensor = self.values(dtensor_vars + dtensor_opt.variables)
                plain = self.values(plain_vars + plain_opt.variables)
                for a, b, c in zip(local, dtensor, plain):
                    # Bit for bit: the same operators on the same values.
                    np.testing.assert_array_equal(a, b)
                    np.testing.assert_array_equal(a, c)
                for a, b in zip(in_step, local):
                    np.testing.assert_array_equal(a, b)
                self.assertEqual(
                    int(self.values([local_opt._iterations])[0]), 3
                )

    def test_the_step_reads_local_tensors_and_restores_dtensors(self):
        variables = [backend.Variable(v) for v in _initial_values()]
        optimizer = optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(variables)
        before = [v._value for v in variables + optimizer.variables]
        seen = {}
        upstream = optimizer._backend_update_step

        def update_step(grads, trainable_variables, learning_rate):
            seen["grads"] = [type(g) for g in grads]
            seen["values"] = [type(v.value) for v in trainable_variables]
            seen["slots"] = [type(v.value) for v in optimizer.variables]
            return upstream(grads, trainable_variables, learning_rate)

        grads = [self.replicated(g) for g in _gradients(0)]
        with mock.patch.object(optimizer, "_backend_update_step", update_step):
            with created_tensors.replicate_created_tensors(self.mesh):
                optimizer.apply(grads, variables)
        self.assertEqual(seen["grads"], [torch.Tensor] * 2)
        self.assertEqual(seen["values"], [torch.Tensor] * 2)
        self.assertEqual(set(seen["slots"]), {torch.Tensor})
        after = [v._value for v in variables + optimizer.variables]
        for old, new in zip(before, after):
            self.assertIs(old, new)
            self.assertIsInstance(new, DTensor)

    def test_values_come_back_when_the_step_raises(self):
        variables = [backend.Variable(v) for v in _initial_values()]
        optimizer = optimizers.SGD(0.1)
        optimizer.build(variables)
        before = [v._value for v in variables + optimizer.variables]
        grads = [self.replicated(g) for g in _gradients(0)]
        with mock.patch.object(
            optimizer, "_backend_update_step", side_effect=RuntimeError("x")
        ):
            with self.assertRaisesRegex(RuntimeError, "x"):
                optimizer.apply(grads, variables)
        for old, variable in zip(before, variables + optimizer.variables):
            self.assertIs(variable._value, old)

    def test_other_placements_keep_the_dtensor_step(self):
        self.pretend_mesh_axes_of_several_processes()
        variables = [backend.Variable(v) for v in _initial_values()]
        optimizer = optimizers.SGD(0.1)
        optimizer.build(variables)
        seen = []
        upstream = optimizer._backend_update_step

        def update_step(grads, trainable_variables, learning_rate):
            seen.append([type(g) for g in grads])
            return upstream(grads, trainable_variables, learning_rate)

        values = _gradients(0)
        cases = {
            "sharded gradient": [
                self.replicated(values[0], [Shard(0)]),
                self.replicated(values[1]),
            ],
            "plain gradient": [
                torch.as_tensor(values[0]),
                self.replicated(values[1]),
            ],
        }
        with mock.patch.object(optimizer, "_backend_update_step", update_step):
            for name, grads in cases.items():
                with self.subTest(name):
                    try:
                        optimizer.apply(grads, variables)
                    except RuntimeError:
                        # DTensor refuses to mix a plain tensor in.
                        pass
                    self.assertIn(DTensor, seen[-1])
        self.assertIsNone(
            replicated_updates.held_values(
                variables, [self.replicated(values[0], [Shard(0)])]
            )
        )

    def test_splits_over_one_process_are_whole_locally(self):
        # Without the pretence, the mesh axis holds one process: a value
        # split over it is whole in the local tensor, as a replicated one.
        variables = [backend.Variable(v) for v in _initial_values()]
        split = self.replicated(_gradients(0)[0], [Shard(0)])
        held = replicated_updates.held_values(variables, [split])
        self.assertEqual([v for v, _ in held], variables)


class ResultOnLocalTensorsTest(_OneProcessDataParallelTest):
    """Metric results of replicated variables are computed locally."""

    def test_results_are_plain_and_variables_come_back(self):
        from keras.src import metrics

        mean = metrics.Mean(name="mean")
        iou = metrics.MeanIoU(num_classes=3, name="iou")
        mean.total.assign(6.0)
        mean.count.assign(4.0)
        iou.total_cm.assign(
            np.array([[2, 1, 0], [0, 3, 0], [1, 0, 1]], "float32")
        )
        trainer = mock.Mock(metrics_variables=mean.variables + iou.variables)
        values = [v._value for v in trainer.metrics_variables]
        for value in values:
            self.assertIsInstance(value, DTensor)

        def get_metrics_result(owner):
            self.assertIs(owner, trainer)
            return {"mean": mean.result(), "iou": iou.result()}

        with created_tensors.replicate_created_tensors(self.mesh):
            results = replicated_updates.result_on_local_tensors(
                trainer, get_metrics_result
            )
        for result in results.values():
            self.assertNotIsInstance(result, DTensor)
        self.assertAllClose(results["mean"], 1.5)
        # Per class intersection over union: 2/4, 3/4, 1/2.
        self.assertAllClose(results["iou"], (0.5 + 0.75 + 0.5) / 3)
        for value, variable in zip(values, trainer.metrics_variables):
            self.assertIs(variable._value, value)
        # On DTensors (as a sharded variable would make it), the same.
        with created_tensors.replicate_created_tensors(self.mesh):
            expected = get_metrics_result(trainer)
        self.assertAllClose(expected["iou"].full_tensor(), results["iou"])

    def test_a_sharded_variable_keeps_dtensors(self):
        self.pretend_mesh_axes_of_several_processes()
        from keras.src import metrics

        mean = metrics.Mean()
        sharded = backend.Variable(np.zeros((2,), "float32"))
        sharded._value = DTensor.from_local(
            sharded._value.to_local(),
            self.mesh.backend_mesh,
            [Shard(0)],
            run_check=False,
        )
        trainer = mock.Mock(metrics_variables=mean.variables + [sharded])
        self.assertIsNone(
            replicated_updates.result_on_local_tensors(trainer, mock.Mock())
        )


class UpdateOnLocalTensorsTest(_OneProcessDataParallelTest):
    """`Mean` and `Sum` updated with replicated values update locally."""

    def updated(self, make_metric, values, sample_weight, local=True):
        """The metric's variables after two updates in a step."""
        metric = make_metric()
        with created_tensors.replicate_created_tensors(self.mesh):
            for _ in range(2):
                if local:
                    metric.update_state(values, sample_weight=sample_weight)
                    continue
                with mock.patch.object(
                    replicated_updates, "held_values", return_value=None
                ):
                    metric.update_state(values, sample_weight=sample_weight)
        return metric

    def test_values_equal_the_dtensor_update(self):
        from keras.src import metrics

        loss = self.replicated(np.float32(0.7310586))
        rows = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
        cases = {
            "loss tracker": (loss, 16),
            "rows and weights": (
                self.replicated(rows),
                self.replicated(np.array([1.0, 0.5, 0.0, 2.0], "float32")),
            ),
            "no weights": (self.replicated(rows), None),
        }
        for name, (values, sample_weight) in cases.items():
            for make_metric in (metrics.Mean, metrics.Sum):
                with self.subTest(name, metric=make_metric.__name__):
                    seen = []
                    upstream = created_tensors.suspended

                    def suspended():
                        seen.append(True)
                        return upstream()

                    with mock.patch.object(
                        created_tensors, "suspended", suspended
                    ):
                        local = self.updated(make_metric, values, sample_weight)
                    dtensor = self.updated(
                        make_metric, values, sample_weight, local=False
                    )
                    # Once per update: the update ran on local tensors.
                    self.assertEqual(len(seen), 2)
                    for a, b in zip(local.variables, dtensor.variables):
                        self.assertIsInstance(a.value, DTensor)
                        self.assertEqual(
                            tuple(a.value.placements), (Replicate(),)
                        )
                        # Bit for bit: the same operators on the same
                        # values.
                        np.testing.assert_array_equal(
                            a.value.to_local().numpy(),
                            b.value.to_local().numpy(),
                        )

    def test_split_or_masked_values_keep_the_dtensor_update(self):
        self.pretend_mesh_axes_of_several_processes()
        from keras.src import metrics

        rows = np.ones((4, 3), "float32")
        split = self.replicated(rows, [Shard(0)])
        masked = self.replicated(rows)
        masked._keras_mask = self.replicated(np.ones((4,), bool))
        for name, values in {"split": split, "masked": masked}.items():
            with self.subTest(name):
                metric = metrics.Mean()
                with mock.patch.object(
                    replicated_updates, "call_on_local_tensors"
                ) as local:
                    with created_tensors.replicate_created_tensors(self.mesh):
                        metric.update_state(values)
                local.assert_not_called()
                self.assertAllClose(metric.result().full_tensor(), 1.0)
