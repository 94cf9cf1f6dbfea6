"""Foundation checks on meshes: variables, layouts, data, collectives.

Usage: foundation_worker.py MESH_SHAPE [MESH_SHAPE ...], e.g. `2`, `1,2`,
`2,1` or `2,2`; the values of each mesh are reported under `<MESH_SHAPE>/`.
A 1-D mesh has the axis `model`; a 2-D mesh has `batch` and `model`.
With the single argument `single` (one process), it reports the reference
values under `single/`: plain Keras, without any distribution. With the
single argument `unseeded`, it reports the unseeded check alone
(`unseeded/`), for a second launch to compare with.
The worker never calls `keras.distribution.initialize()`: under torchrun,
the first use of `keras.distribution` initializes on its own.
"""

import sys

import numpy as np
import worker_utils
from worker_utils import record
from worker_utils import record_error

import keras
from keras.src.backend.torch import distribution_lib as backend_dlib


def placements_of(variable):
    return [str(p) for p in variable.value.placements]


def local_of(variable):
    return variable.value.to_local().detach().cpu().numpy()


def build_model():
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(16, name="up")(inputs)
    hidden = keras.layers.Dense(8, name="down")(hidden)
    outputs = keras.layers.Dense(4, name="head")(hidden)
    return keras.Model(inputs, outputs)


def check_devices():
    record("devices", keras.distribution.list_devices())
    record("device_count", keras.distribution.get_device_count())
    record("num_processes", backend_dlib.num_processes())
    record("process_id", backend_dlib.process_id())


def check_model_variables(model):
    for variable in model.variables:
        record(f"placements/{variable.path}", placements_of(variable))
        record(f"local_shape/{variable.path}", list(local_of(variable).shape))
        record(f"local/{variable.path}", local_of(variable))
        record(f"full/{variable.path}", variable.numpy())
    record("weights", [w.tolist() for w in model.get_weights()])


def check_multi_axis(mesh):
    """One dimension over two mesh axes, in both orders."""
    if len(mesh.shape) != 2:
        return
    full = np.arange(8 * 3, dtype="float32").reshape(8, 3)
    for name, axes in (
        ("batch_major", (("batch", "model"), None)),
        ("model_major", (("model", "batch"), None)),
    ):
        layout = keras.distribution.TensorLayout(axes, mesh)
        variable = keras.Variable(full, layout=layout, name=name)
        record(f"multi_axis/{name}/placements", placements_of(variable))
        record(f"multi_axis/{name}/local", local_of(variable))
        record(f"multi_axis/{name}/full", variable.numpy())
    coordinate = mesh.backend_mesh.get_coordinate()
    record("mesh_coordinate", list(coordinate))


def check_assign(model):
    kernel = model.get_layer("up").kernel
    new_value = np.arange(8 * 16, dtype="float32").reshape(8, 16) / 100.0
    kernel.assign(new_value)
    record("assign_numpy/placements", placements_of(kernel))
    record("assign_numpy/local", local_of(kernel))
    record("assign_numpy/full", kernel.numpy())
    # A DTensor of another layout: fully replicated on the same mesh.
    mesh = keras.distribution.distribution().device_mesh
    replicated = backend_dlib.distribute_tensor(
        keras.ops.convert_to_tensor(new_value * 2.0),
        keras.distribution.TensorLayout((None, None), mesh),
    )
    kernel.assign(replicated)
    record("assign_dtensor/placements", placements_of(kernel))
    record("assign_dtensor/full", kernel.numpy())
    model.set_weights([w * 0 + 1.5 for w in model.get_weights()])
    record("set_weights/placements", placements_of(kernel))
    record("set_weights/local_shape", list(local_of(kernel).shape))
    record("set_weights/full_sum", float(kernel.numpy().sum()))


def check_optimizer_slots(model):
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    slots = {
        v.path: placements_of(v)
        for v in optimizer.variables
        if "momentum" in v.path
    }
    record("slot_placements", slots)


def check_distribute_tensor(mesh):
    data = np.arange(4 * 6, dtype="float32").reshape(4, 6)
    layout = keras.distribution.TensorLayout((None, "model"), mesh)
    nested = {
        "a": keras.ops.convert_to_tensor(data),
        "b": (keras.ops.convert_to_tensor(data + 1), None),
    }
    out = keras.distribution.distribute_tensor(nested, layout)
    record("distribute/a/placements", [str(p) for p in out["a"].placements])
    record("distribute/a/local", out["a"].to_local().numpy())
    record("distribute/b/local", out["b"][0].to_local().numpy())
    record("distribute/b/none_kept", out["b"][1] is None)
    replicated = keras.distribution.TensorLayout((None, None), mesh)
    again = keras.distribution.distribute_tensor(out["a"], replicated)
    record("redistribute/placements", [str(p) for p in again.placements])
    record("redistribute/local", again.to_local().numpy())


def check_data_input(mesh):
    # Processes of one replica (same batch coordinate) pass the same part.
    batch_axis = mesh.axis_names[0]
    shard = mesh.backend_mesh.get_local_rank(batch_axis)
    local = np.full((2, 3), float(shard), dtype="float32")
    layout = keras.distribution.TensorLayout((batch_axis, None), mesh)
    global_batch = backend_dlib.distribute_data_input(local, layout, batch_axis)
    record("data_input/shape", list(global_batch.shape))
    record("data_input/local", global_batch.to_local().numpy())
    record("data_input/full", keras.ops.convert_to_numpy(global_batch))
    # keras 3.16's two-argument form: the layout names the batch axis.
    two_arguments = backend_dlib.distribute_data_input(local, layout)
    record(
        "data_input/two_arguments_full",
        keras.ops.convert_to_numpy(two_arguments),
    )


def check_collectives(model):
    rank = worker_utils.rank()
    value = np.array([rank + 1.0, 10.0 * (rank + 1)], dtype="float32")
    record("all_reduce/sum", backend_dlib.all_reduce(value).numpy())
    record("all_reduce/mean", backend_dlib.all_reduce(value, "mean").numpy())
    record("all_reduce/max", backend_dlib.all_reduce(value, "max").numpy())
    record("all_gather", backend_dlib.all_gather(value).numpy())
    kernel = model.get_layer("up").kernel
    record("all_gather/variable", backend_dlib.all_gather(kernel).numpy())


def check_errors(mesh):
    def make(shape, axes, name):
        layout = keras.distribution.TensorLayout(axes, mesh)
        keras.Variable(np.zeros(shape, "float32"), layout=layout, name=name)

    record_error("error/rank", lambda: make((4, 4), ("model",), "bad_rank"))
    if mesh.shape[-1] > 1:
        record_error(
            "error/indivisible", lambda: make((3, 4), ("model", None), "odd")
        )
    record_error(
        "error/twice", lambda: make((4, 4), ("model", "model"), "twice")
    )
    record_error(
        "error/unknown",
        lambda: keras.distribution.TensorLayout(("nope", None), mesh),
    )


class Pair(keras.layers.Layer):
    """Returns a tuple of two tensors."""

    def call(self, x):
        return x * 2.0, x + 1.0


class Named(keras.layers.Layer):
    """Returns a dict of two tensors."""

    def call(self, x):
        return {"double": x * 2.0, "shift": x - 1.0}


def build_outputs_model():
    """A model whose outputs include a tuple and a dict layer's tensors."""
    keras.utils.set_random_seed(11)
    inputs = keras.Input((8,))
    first, second = Pair(name="pair")(inputs)
    named = Named(name="named")(inputs)
    mixed = first + second + named["double"] * named["shift"]
    out = keras.layers.Dense(8, name="proj")(mixed)
    outputs = {
        "proj": out,
        "pair_0": first,
        "pair_1": second,
        "named_double": named["double"],
        "named_shift": named["shift"],
    }
    return keras.Model(inputs, outputs)


def outputs_input():
    return np.arange(4 * 8, dtype="float32").reshape(4, 8) / 10.0


def check_outputs(mesh):
    """`<layer path>/output` layouts, on layers returning a tensor, a tuple
    and a dict: the placements, local shards and full values of each."""
    model = build_outputs_model()
    batch = backend_dlib.distribute_global_batch(
        outputs_input(),
        keras.distribution.TensorLayout((mesh.axis_names[0], None), mesh),
    )
    for name, result in model(batch).items():
        record(
            f"outputs/{name}/placements", [str(p) for p in result.placements]
        )
        record(f"outputs/{name}/local", result.to_local().detach().numpy())
        record(f"outputs/{name}/value", keras.ops.convert_to_numpy(result))


def reference():
    """The reference values, from plain Keras without any distribution."""
    keras.utils.set_random_seed(7)
    model = build_model()
    for variable in model.variables:
        record(f"full/{variable.path}", variable.numpy())
    record("weights", [w.tolist() for w in model.get_weights()])
    outputs = build_outputs_model()(outputs_input())
    for name, result in outputs.items():
        record(f"outputs/{name}/value", keras.ops.convert_to_numpy(result))


def check_progbar(model):
    """Counts the progress lines a `fit` with `verbose=2` prints."""
    import contextlib
    import io

    model.compile(optimizer="sgd", loss="mse")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        model.fit(
            np.ones((8, 8), "float32"),
            np.ones((8, 4), "float32"),
            batch_size=4,
            epochs=2,
            verbose=2,
        )
    record("progbar_epoch_lines", output.getvalue().count("Epoch "))


def check_mesh(mesh_shape):
    """Runs every check under `ModelParallel` on a mesh of `mesh_shape`."""
    axes = ("model",) if len(mesh_shape) == 1 else ("batch", "model")
    # Names (of optimizer slots, for one) as in a fresh process.
    keras.backend.clear_session()
    keras.utils.set_random_seed(7)
    check_devices()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(mesh_shape, axes, devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down.kernel"] = ("model", None)  # torch-style separator
    if len(axes) == 1:
        layout_map["pair/output"] = (None, "model")
        layout_map["named/output"] = ("model", None)
        layout_map["proj/output"] = ("model", None)
    else:
        layout_map["pair/output"] = ("batch", "model")
        layout_map["named/output"] = (None, "model")
        layout_map["proj/output"] = ("batch", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    model = build_model()
    check_model_variables(model)
    check_multi_axis(mesh)
    check_optimizer_slots(model)
    check_distribute_tensor(mesh)
    check_data_input(mesh)
    check_collectives(model)
    check_errors(mesh)
    check_outputs(mesh)
    check_assign(model)
    check_progbar(model)
    keras.distribution.set_distribution(None)


def check_unseeded_variables():
    """Weights of a model built under `DataParallel` before any seed is set.

    They are replicated, so they must be identical on every process: the
    random seed that `initialize()` shares stands in for the user's.
    """
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()
        )
    )
    model = build_model()
    record("unseeded/weights", [w.tolist() for w in model.get_weights()])
    record(
        "unseeded/placements",
        [placements_of(v) for v in model.weights],
    )
    keras.distribution.set_distribution(None)


def check_initializes_on_first_use():
    """Nothing calls `initialize()`: under torchrun, the first use of
    `keras.distribution` joins the process group on its own."""
    import torch.distributed as dist

    record("initialized_before_first_use", dist.is_initialized())
    devices = keras.distribution.list_devices()
    record("initialized_after_first_use", dist.is_initialized())
    record("first_use/devices", devices)
    record("first_use/world_size", dist.get_world_size())
    record("first_use/rank", dist.get_rank())


def main():
    if sys.argv[1:] == ["single"]:
        with worker_utils.prefixed("single"):
            reference()
        worker_utils.report()
        return
    if sys.argv[1:] == ["unseeded"]:
        check_unseeded_variables()
        worker_utils.report()
        return
    check_initializes_on_first_use()
    check_unseeded_variables()
    for mesh_arg in sys.argv[1:]:
        with worker_utils.prefixed(mesh_arg):
            check_mesh(tuple(int(s) for s in mesh_arg.split(",")))
    worker_utils.report()


if __name__ == "__main__":
    main()
