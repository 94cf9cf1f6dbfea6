"""Counts the collectives of one training step under a distribution.

Usage: collectives_worker.py RUN [RUN ...] (under torchrun), each RUN
being `MODE:OPTIMIZER[:CAP[:UNIT_CAP]]`:
  MODE: `dp` (`DataParallel`, a 3-layer MLP), `tp` (`ModelParallel` on a
    (1, N) mesh, a replicated layer, then a Megatron MLP block: column-
    then row-parallel kernels, then a replicated head), `tplora` (`tp`
    with LoRA on the block's two layers: replicated factors whose
    gradients come split or partial) or `fsdp`
    (`ModelParallel` on an (N,) "batch" mesh, the MLP of `dp` laid out by
    `fully_sharded_layouts`: its two hidden kernels sharded, the head's
    kernel and the biases replicated), `fsdpblocks` (the same layouts
    for two blocks, each a layer of two Dense sublayers, then a head) or
    `fsdpremat` (`fsdpblocks` with both blocks recomputed in backward,
    `remat_layers`), or `fsdpflat` (a flat functional model of repeated
    residual blocks between a first Dense and a head, every variable
    sharded).
  OPTIMIZER: `sgd` (with momentum) or `adamw`.
  CAP: gradient bucket cap in MB (`KERAS_DTENSOR_BUCKET_CAP_MB`), empty
    for the default.
  UNIT_CAP: the gathered size in MB up to which consecutive units of
    fully sharded variables are joined (`KERAS_DTENSOR_UNIT_CAP_MB`).
After two warm-up steps, one `train_on_batch` runs under the benchmark's
`CollectiveCounter` (a `CommDebugMode`);
the counts per collective are reported under `<RUN>/counts`, those of
forward alone (up to the loss) under `<RUN>/forward_counts`, with the
number of trainable variables, the losses, and the losses of the same
model trained without a distribution on the same batches. Under `fsdp`,
also each variable's placements and local shape, and the final weights of
both models.
"""

import contextlib
import os
import sys
import warnings
from unittest import mock

import numpy as np
import worker_utils
from worker_utils import record

# The benchmark's collective counter: `CommDebugMode` without its module
# tracker, which Keras layers nested in layers confuse.
sys.path.insert(
    0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
)
from measure import CollectiveCounter  # noqa: E402

import keras  # noqa: E402
import keras_dtensor as kd  # noqa: E402

BATCH, FEATURES, HIDDEN = 8, 16, 32


class Block(keras.layers.Layer):
    """Two Dense sublayers, the first with a ReLU."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(HIDDEN, activation="relu", name="first")
        self.second = keras.layers.Dense(HIDDEN, name="second")

    def call(self, x):
        return self.second(self.first(x))


def build(mode):
    """A 3-layer MLP for `dp` and `fsdp`, the Megatron block model for
    `tp`, two blocks and a head for `fsdpblocks` and `fsdpremat`; for
    `fsdpflat`, a first Dense, two residual blocks of two Dense layers
    each, all direct layers of one functional model, and a head."""
    inputs = keras.Input((FEATURES,))
    if mode in ("fsdpblocks", "fsdpremat"):
        x = Block(name="block1")(inputs)
        x = Block(name="block2")(x)
    elif mode == "fsdpflat":
        x = keras.layers.Dense(HIDDEN, name="pre")(inputs)
        for i in range(2):
            y = keras.layers.Dense(
                2 * HIDDEN, activation="relu", name=f"b{i}_up"
            )(x)
            y = keras.layers.Dense(HIDDEN, name=f"b{i}_down")(y)
            x = keras.layers.Add(name=f"b{i}_add")([x, y])
    elif mode in ("dp", "fsdp"):
        x = keras.layers.Dense(HIDDEN, activation="relu", name="d1")(inputs)
        x = keras.layers.Dense(HIDDEN, activation="relu", name="d2")(x)
    else:
        # A replicated layer, so that the block's input needs a gradient.
        x = keras.layers.Dense(FEATURES, activation="relu", name="pre")(inputs)
        x = keras.layers.Dense(HIDDEN, activation="relu", name="up")(x)
        x = keras.layers.Dense(FEATURES, name="down")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    model = keras.Model(inputs, outputs)
    if mode == "tplora":
        for name in ("up", "down"):
            model.get_layer(name).enable_lora(2)
    return model


# Layouts under `tp`: a Megatron block between replicated layers.
MP_LAYOUTS = {
    "pre/output": ("batch", None),
    "up/kernel": (None, "model"),
    "up/bias": ("model",),
    "down/kernel": ("model", None),
    "down/output": ("batch", None),
}


# Under `fsdp`, variables of at least this many elements are sharded: the
# kernels of d1 (512) and d2 (1024), not the head's (128).
FSDP_MIN_SIZE = 256


def set_fully_sharded_distribution(mode):
    """`ModelParallel` on an (N,) "batch" mesh, by `fully_sharded_layouts`."""
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ("batch",), devices)
    # `fsdpflat` shards every variable, as FSDP2 shards every parameter.
    min_size = 0 if mode == "fsdpflat" else FSDP_MIN_SIZE
    with keras.StatelessScope():
        layout_map = kd.fully_sharded_layouts(
            build(mode), mesh, "batch", min_size=min_size
        )
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


# The `CollectiveCounter` of the counted step, while it runs.
_COUNTING = []
# What the counted step did, in order: "gradients reduced" (the gradient
# buckets' end of backward), "loss all-reduced" (the all-reduce of a
# mean computed on local tensors, the loss's under `dp`) and "layer end
# replayed" (a local run's all-reduce where a row-parallel layer ends).
_EVENTS = []
# The counts when the loss was computed, i.e. after forward.
_FORWARD_COUNTS = {}
# The warnings the last counted step raised.
_WARNINGS = []


def counted_mse(y_true, y_pred):
    """Mean squared error; in the counted step, first notes the counts so
    far (those of forward: the loss is computed right after it)."""
    if _COUNTING:
        counts = _COUNTING[-1].get_comm_counts()
        _FORWARD_COUNTS.clear()
        _FORWARD_COUNTS.update({str(op): n for op, n in counts.items() if n})
    return keras.losses.mean_squared_error(y_true, y_pred)


def make_optimizer(name):
    """`sgd` (momentum 0.9), `adamw`, or `lso`: SGD with momentum inside a
    `LossScaleOptimizer`, which scales the loss before backward."""
    if name == "adamw":
        return keras.optimizers.AdamW(0.01)
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    if name == "lso":
        return keras.optimizers.LossScaleOptimizer(sgd, initial_scale=2.0**8)
    return sgd


def train(mode, optimizer_name, distributed=True):
    """Returns the model and its losses over 3 steps (the last counted)."""
    # `tp` is tensor parallelism on the (1, N) mesh of `mp`.
    if mode.startswith("fsdp") and distributed:
        set_fully_sharded_distribution(mode)
    else:
        distribution_mode = {"dp": "dp", "tp": "mp", "tplora": "mp"}.get(
            mode, "single"
        )
        worker_utils.set_distribution(
            distribution_mode if distributed else "single", MP_LAYOUTS
        )
    keras.utils.set_random_seed(7)
    model = build(mode)
    optimizer = make_optimizer(optimizer_name)
    model.compile(optimizer=optimizer, loss=counted_mse)
    if mode == "fsdpremat":
        kd.remat_layers(model, r"block\d")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, BATCH, FEATURES)).astype("float32")
    y = rng.normal(size=(3, BATCH, 4)).astype("float32")
    losses = [float(model.train_on_batch(x[i], y[i])) for i in range(2)]
    with CollectiveCounter() as comm, step_events():
        _COUNTING.append(comm)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses.append(float(model.train_on_batch(x[2], y[2])))
        finally:
            _COUNTING.pop()
    counts = {str(op): n for op, n in comm.get_comm_counts().items() if n}
    _WARNINGS[:] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return model, losses, counts


CAP_ENV_VARS = ("KERAS_DTENSOR_BUCKET_CAP_MB", "KERAS_DTENSOR_UNIT_CAP_MB")


@contextlib.contextmanager
def step_events():
    """Records `_EVENTS` (cleared first) while the block runs."""
    from keras.src.backend.torch import local_call_state
    from keras.src.backend.torch import reducer
    from keras.src.backend.torch import torch_runtime

    def noting(event, function):
        def noted(*args, **kwargs):
            name = event() if callable(event) else event
            if not _EVENTS or _EVENTS[-1] != name:
                _EVENTS.append(name)
            return function(*args, **kwargs)

        return noted

    def all_reduce_event():
        # Inside a local run, the all-reduce where a sublayer ends
        # (`local_replays`); elsewhere, that of a loss reduced on local
        # tensors (`batch_reductions`).
        if local_call_state.step_state().replays:
            return "layer end replayed"
        return "loss all-reduced"

    _EVENTS.clear()
    finish = reducer._finish_backward
    all_reduce = torch_runtime.all_reduce_sum
    with (
        mock.patch.object(
            reducer,
            "_finish_backward",
            noting("gradients reduced", finish),
        ),
        mock.patch.object(
            torch_runtime,
            "all_reduce_sum",
            noting(all_reduce_event, all_reduce),
        ),
    ):
        yield


def reductions():
    """Local loss reductions against upstream's on DTensors, per case.

    Per case (reduction, with or without sample weights) and path (local,
    or upstream's on DTensors): the bits of the value and of the
    per-sample values' gradient, the value's placements, the collectives,
    and whether the values' local tensor was read (the local path). Also
    whether the value's all-reduce was still unread when the reduction
    returned. A masked
    reduction is also reported (it keeps upstream's path).
    """
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch import batch_reductions
    from keras.src.backend.torch import created_tensors
    from keras.src.losses import loss as loss_module

    worker_utils.set_distribution("dp", MP_LAYOUTS)
    mesh = keras.distribution.distribution().device_mesh
    rng = np.random.default_rng(3)
    values = rng.normal(size=(BATCH * 2, 3)).astype("float32")
    weights = rng.uniform(size=(BATCH * 2, 1)).astype("float32")

    def split(array, requires_grad=False):
        tensor = distribute_tensor(
            torch.tensor(array), mesh.backend_mesh, [Shard(0)]
        )
        return tensor.requires_grad_(requires_grad)

    def reduce(reduction, weighted=False, masked=False, local=True):
        per_sample = split(values, requires_grad=True)
        weight = split(weights) if weighted else None
        mask = split(np.ones(values.shape, dtype=bool)) if masked else None
        upstream_values = mock.patch.object(
            torch.distributed.tensor.DTensor,
            "to_local",
            autospec=True,
            side_effect=torch.distributed.tensor.DTensor.to_local,
        )
        kept = mock.patch.object(
            batch_reductions,
            "_local_plan",
            **({} if local else {"return_value": None}),
            wraps=batch_reductions._local_plan,
        )
        with CollectiveCounter() as comm, upstream_values as read, kept:
            with created_tensors.replicate_created_tensors(mesh):
                value = loss_module.reduce_weighted_values(
                    per_sample,
                    sample_weight=weight,
                    mask=mask,
                    reduction=reduction,
                )
            pending = _unread(value)
            value.backward()
        counts = {str(op): n for op, n in comm.get_comm_counts().items() if n}
        return {
            "value": value.full_tensor().detach().numpy().tobytes().hex(),
            "grad": per_sample.grad.full_tensor().numpy().tobytes().hex(),
            "placements": [str(p) for p in value.placements],
            "counts": counts,
            # The local path reads the values' local tensor.
            "local": any(c.args[0] is per_sample for c in read.call_args_list),
            "pending": pending,
        }

    # The full arrays, for a plain reduction by the test.
    record(
        "reduce/inputs",
        {"values": values.tolist(), "weights": weights.tolist()},
    )
    for reduction in ("sum_over_batch_size", "sum"):
        for weighted in (False, True):
            case = f"reduce/{reduction}:{int(weighted)}"
            record(f"{case}/local", reduce(reduction, weighted))
            record(f"{case}/dtensor", reduce(reduction, weighted, local=False))
    record("reduce/masked", reduce("sum_over_batch_size", masked=True))


def whole_losses():
    """A built-in loss called three times in a step, against the same loss
    computed on DTensors, per case (reduction, with or without sample
    weights).

    Per call: the bits of the value and of the logits' gradient, the
    value's placements, the collectives, whether the per-sample values
    went through `batch_local.call_layer`, and whether they reached the
    reduction as DTensors (the third call runs the whole loss on local
    tensors, `batch_reductions.call_loss`, and does neither). The
    reference is the loss with local calls and local reductions off:
    every operator on DTensors.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch import batch_local
    from keras.src.backend.torch import batch_reductions
    from keras.src.backend.torch import created_tensors

    worker_utils.set_distribution("dp", MP_LAYOUTS)
    mesh = keras.distribution.distribution().device_mesh
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(BATCH * 2, 5)).astype("float32")
    labels = rng.integers(0, 5, size=(BATCH * 2,))
    weights = rng.uniform(size=(BATCH * 2,)).astype("float32")

    def split(array, requires_grad=False):
        tensor = distribute_tensor(
            torch.tensor(array), mesh.backend_mesh, [Shard(0)]
        )
        return tensor.requires_grad_(requires_grad)

    def call(loss, weighted):
        targets = split(labels)
        predictions = split(logits, requires_grad=True)
        weight = split(weights) if weighted else None
        per_sample = mock.patch.object(
            batch_local, "call_layer", wraps=batch_local.call_layer
        )
        reduction = mock.patch.object(
            batch_reductions,
            "reduce_on_local_tensors",
            wraps=batch_reductions.reduce_on_local_tensors,
        )
        with CollectiveCounter() as comm, per_sample as local, reduction as r:
            with created_tensors.replicate_created_tensors(mesh):
                value = loss(targets, predictions, sample_weight=weight)
            value.backward()
        counts = {str(op): n for op, n in comm.get_comm_counts().items() if n}
        return {
            "value": value.full_tensor().detach().numpy().tobytes().hex(),
            "grad": predictions.grad.full_tensor().numpy().tobytes().hex(),
            "placements": [str(p) for p in value.placements],
            "counts": counts,
            "per_sample_call": local.called,
            "dtensor_values_reduced": any(
                type(c.args[1]) is DTensor for c in r.call_args_list
            ),
        }

    # The full arrays, for a plain cross-entropy by the test.
    record(
        "wholeloss/inputs",
        {
            "logits": logits.tolist(),
            "labels": labels.tolist(),
            "weights": weights.tolist(),
        },
    )
    for reduction in ("sum_over_batch_size", "sum"):
        for weighted in (False, True):
            case = f"wholeloss/{reduction}:{int(weighted)}"

            def make_loss():
                return keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction=reduction
                )

            loss = make_loss()
            record(f"{case}/calls", [call(loss, weighted) for _ in range(3)])
            dtensors = mock.patch.object(batch_local, "ENABLED", False)
            upstream = mock.patch.object(
                batch_reductions, "_local_plan", return_value=None
            )
            with dtensors, upstream:
                record(f"{case}/dtensor", call(make_loss(), weighted))


def _unread(value):
    """Whether `value`'s local tensor is an all-reduce not yet waited for."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    local = value._local_tensor
    return type(local) is AsyncCollectiveTensor and not local.completed


def batch_rows():
    """This process's rows of global batches, planned once per shape,
    against DTensor's `distribute_tensor`, per case: the local rows, the
    placements, global shape and stride, and whether the plan made them."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch import batch_distribution
    from keras.src.backend.torch import dtensor_layouts

    worker_utils.set_distribution("dp", MP_LAYOUTS)
    distribution = keras.distribution.distribution()
    rng = np.random.default_rng(5)
    cases = {
        "even": rng.normal(size=(BATCH * 2, 3)).astype("float32"),
        "uneven": rng.normal(size=(BATCH * 2 - 1, 3)).astype("float32"),
        "int": rng.integers(0, 9, size=(BATCH * 2,)),
    }
    for name, array in cases.items():
        batch = torch.tensor(array)
        layout = distribution.get_data_layout(batch.shape)
        backend = dtensor_layouts.backend_layout(layout)
        planned = batch_distribution._even_rows(batch, layout)
        made = batch_distribution.distribute_global_batch(batch, layout)
        expected = distribute_tensor(
            batch, backend.mesh, backend.placements, src_data_rank=None
        )

        def described(value):
            return [
                value.to_local().tolist(),
                [str(p) for p in value.placements],
                list(value.shape),
                list(value.stride()),
                str(value.dtype),
            ]

        record(
            f"rows/{name}",
            {
                "planned": planned is not None,
                "made": described(made),
                "expected": described(expected),
            },
        )


def run(spec):
    if spec == "reduce":
        return reductions()
    if spec == "rows":
        return batch_rows()
    if spec == "wholeloss":
        return whole_losses()
    mode, optimizer_name, *caps = spec.split(":")
    for name, cap in zip(CAP_ENV_VARS, caps):
        if cap:
            os.environ[name] = cap
    model, losses, counts = train(mode, optimizer_name)
    for name in CAP_ENV_VARS:
        os.environ.pop(name, None)
    record(f"{spec}/counts", counts)
    record(f"{spec}/forward_counts", dict(_FORWARD_COUNTS))
    record(f"{spec}/trainable", len(model.trainable_variables))
    record(f"{spec}/losses", losses)
    record(f"{spec}/events", list(_EVENTS))
    record(f"{spec}/warnings", list(_WARNINGS))
    if mode.startswith("fsdp"):
        record(f"{spec}/layouts", variable_layouts(model))
        record(f"{spec}/weights", weights(model))
    reference_model, reference, _ = train(
        mode, optimizer_name, distributed=False
    )
    record(f"{spec}/reference_losses", reference)
    record(f"{spec}/reference_warnings", list(_WARNINGS))
    if mode.startswith("fsdp"):
        record(f"{spec}/reference_weights", weights(reference_model))


def variable_layouts(model):
    """Per variable path, its placements and local shape on this rank."""
    return {
        v.path: [[str(p) for p in v.value.placements], list(local_shape(v))]
        for v in model.weights
    }


def local_shape(variable):
    return variable.value.to_local().shape


def weights(model):
    """Per variable path, its full value (a list)."""
    return {
        v.path: keras.ops.convert_to_numpy(v.value).tolist()
        for v in model.weights
    }


def main():
    worker_utils.run_all(
        run, sys.argv[1:], mode_of=lambda spec: spec.split(":")[0]
    )


if __name__ == "__main__":
    main()
