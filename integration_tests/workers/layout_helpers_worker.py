"""Trains a small transformer on an (fsdp x model) mesh built by the helpers.

Usage:
    layout_helpers_worker.py FSDP,MODEL  (under torchrun, FSDP*MODEL ranks)
    layout_helpers_worker.py --print-layouts FSDP,MODEL [--apply]  (any
        backend, one process: prints the helpers' layouts as JSON, key ->
        axes; with --apply, also creates and trains the model under them)

Under torchrun, every rank first trains the model without a distribution
(the single-process reference), then builds the same model abstractly,
lays it out only with `tensor_parallel_layouts`, `fully_sharded_layouts`
and `merge_layouts`, trains it on the mesh and reports placements, local
shapes, per-rank parameter bytes, initial weights, losses and the last
step's gradients. Then every block is recomputed in backward
(`remat_layers`) in a single-process run, under DataParallel, under tensor
parallelism alone (a (1, N) mesh) and under the same 2-D layouts; each
reports its losses, gradients and the blocks' calls during backward.
"""

import json
import math
import sys

import numpy as np

import keras
import keras_dtensor as kd

SEED = 1234
VOCAB, SEQ, HIDDEN, HEADS, BLOCKS, BATCH, STEPS = 64, 8, 32, 4, 2, 8, 3
MIN_SIZE = 256
REMAT_PATTERN = r"block_\d+"

# Calls of `TransformerBlock.call` while autograd's backward pass runs
# (recomputations).
BACKWARD_CALLS = [0]


class TransformerBlock(keras.layers.Layer):
    """Post-norm transformer block: attention, then a ReLU feed-forward."""

    def __init__(self, hidden, heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(
            heads, hidden // heads, name="attention"
        )
        self.ln_1 = keras.layers.LayerNormalization(name="ln_1")
        self.ffn_in = keras.layers.Dense(
            4 * hidden, activation="relu", name="ffn_in"
        )
        self.ffn_out = keras.layers.Dense(hidden, name="ffn_out")
        self.ln_2 = keras.layers.LayerNormalization(name="ln_2")

    def call(self, x):
        if torch_in_backward():
            BACKWARD_CALLS[0] += 1
        # The attention scores path (einsum and softmax) rather than fused
        # SDPA: DTensor has no sharding rule for the backward of the CPU
        # flash-attention kernel.
        attended, _ = self.attention(x, x, return_attention_scores=True)
        x = self.ln_1(x + attended)
        return self.ln_2(x + self.ffn_out(self.ffn_in(x)))


def torch_in_backward():
    """Whether torch's autograd engine is running a backward pass."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch._C._current_graph_task_id() != -1


def build_model():
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(tokens)
    for i in range(BLOCKS):
        x = TransformerBlock(HIDDEN, HEADS, name=f"block_{i}")(x)
    logits = keras.layers.Dense(VOCAB, name="head")(x)
    return keras.Model(tokens, logits, name="lm")


PLAN = {
    r"block_\d+/attention/(query|key|value)": "column",
    r"block_\d+/attention/attention_output": "row",
    r"block_\d+/ffn_in": "column",
    r"block_\d+/ffn_out": "row",
}


def tensor_parallel_plan():
    """`PLAN` with its styles on the "model" axis."""
    styles = {"column": kd.column_parallel, "row": kd.row_parallel}
    return {key: styles[style]("model") for key, style in PLAN.items()}


def layout_map_for(model, mesh):
    """The helper calls under test: a TP plan, then FSDP on top."""
    tensor_parallel = kd.tensor_parallel_layouts(
        model, mesh, tensor_parallel_plan()
    )
    fully_sharded = kd.fully_sharded_layouts(
        model, mesh, "fsdp", min_size=MIN_SIZE, layout_map=tensor_parallel
    )
    return kd.merge_layouts(model, tensor_parallel, fully_sharded)


def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype("int32")
    targets = np.roll(tokens, -1, axis=1)
    return tokens, targets


def compile_and_fit(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.5, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tokens, targets = data()
    history = model.fit(
        tokens,
        targets,
        batch_size=BATCH,
        epochs=STEPS,
        shuffle=False,
        verbose=0,
    )
    return [float(loss) for loss in history.history["loss"]]


def axes_to_json(axes):
    return [list(a) if isinstance(a, tuple) else a for a in axes]


def layouts_json(layout_map):
    return {
        key: axes_to_json(axes)
        for key, axes in kd.layout_map_axes(layout_map).items()
    }


def set_numpy_weights(model):
    """Overwrites every weight with values drawn from numpy.

    Keras initializers draw from the backend's own generator, so only
    numpy values make weights equal across backends.
    """
    rng = np.random.default_rng(SEED)
    for variable in model.weights:
        values = rng.normal(0.0, 0.2, size=tuple(variable.shape))
        variable.assign(values.astype(variable.dtype))


def numpy_weight_losses():
    """Losses of the model without a distribution, from numpy weights."""
    model = build_model()
    set_numpy_weights(model)
    return compile_and_fit(model)


def print_layouts(mesh_shape, apply):
    """Prints the helpers' layouts on the current backend, as JSON.

    With `apply`, the model is also created and trained under
    `ModelParallel` with those layouts on the backend's own devices (from
    numpy weights, next to a run without a distribution), and each
    variable's sharding spec (JAX) is printed too.
    """
    count = math.prod(mesh_shape)
    devices = [f"cpu:{i}" for i in range(count)]
    result = {"backend": keras.backend.backend()}
    if apply:
        devices = keras.distribution.list_devices()[:count]
        result["reference_losses"] = numpy_weight_losses()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("fsdp", "model"), devices)
    with keras.StatelessScope():
        model = build_model()
        layout_map = layout_map_for(model, mesh)
        if apply:
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(layout_map=layout_map)
            )
    result["layouts"] = layouts_json(layout_map)
    if apply:
        result["specs"] = {
            v.path: axes_to_json(tuple(v.value.sharding.spec))
            for v in model.weights
        }
        set_numpy_weights(model)
        result["losses"] = compile_and_fit(model)
    print(json.dumps(result))


def record_training(prefix, model):
    """Trains `model`; records its losses, last gradients, backward calls.

    The gradients are those of the last training step, gathered in full
    on every process (the same collectives, in the same order, on each).
    """
    from worker_utils import record

    BACKWARD_CALLS[0] = 0
    record(f"{prefix}losses", compile_and_fit(model))
    record(f"{prefix}backward_calls", BACKWARD_CALLS[0])
    for variable in model.trainable_weights:
        gradient = keras.ops.convert_to_numpy(variable.value.grad)
        record(f"{prefix}gradients/{variable.path}", gradient)


def run_remat(mode, mesh_shape):
    """Trains the model with every block recomputed under `mode`."""
    devices = keras.distribution.list_devices()
    keras.utils.set_random_seed(SEED)
    if mode == "single":
        keras.distribution.set_distribution(None)
        model = build_model()
    elif mode == "dp":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
        model = build_model()
    else:
        shape = (1, len(devices)) if mode == "tp" else mesh_shape
        mesh = keras.distribution.DeviceMesh(shape, ("fsdp", "model"), devices)
        with keras.StatelessScope():
            model = build_model()
            if mode == "tp":
                layout_map = kd.tensor_parallel_layouts(
                    model, mesh, tensor_parallel_plan()
                )
            else:
                layout_map = layout_map_for(model, mesh)
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(layout_map=layout_map)
            )
    paths = kd.remat_layers(model, REMAT_PATTERN)
    from worker_utils import record

    record(f"remat/{mode}/paths", paths)
    record_training(f"remat/{mode}/", model)
    keras.distribution.set_distribution(None)


def run_distributed(mesh_shape):
    import worker_utils
    from worker_utils import record

    keras.distribution.initialize()

    # The single-process reference: no distribution.
    keras.utils.set_random_seed(SEED)
    reference = build_model()
    initial = {v.path: keras.ops.convert_to_numpy(v) for v in reference.weights}
    record_training("reference_", reference)

    # The same model, laid out only by the helpers, built abstractly.
    keras.utils.set_random_seed(SEED)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("fsdp", "model"), devices)
    with keras.StatelessScope():
        model = build_model()
        layout_map = layout_map_for(model, mesh)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
    # Leaving the scope created every variable, already sharded.
    record("layouts", layouts_json(layout_map))
    local_bytes = 0
    for variable in model.weights:
        path = variable.path
        local = variable.value.to_local()
        local_bytes += local.numel() * local.element_size()
        record(
            f"placements/{path}", [str(p) for p in variable.value.placements]
        )
        record(f"local_shape/{path}", list(local.shape))
        record(f"global_shape/{path}", list(variable.shape))
        record(f"element_size/{path}", local.element_size())
        record(f"local/{path}", local.detach().numpy())
        record(f"full/{path}", initial[path])
        record(f"gathered/{path}", keras.ops.convert_to_numpy(variable))
    record("local_parameter_bytes", local_bytes)
    record_training("", model)
    record(
        "slot_placements",
        {
            v.path: [str(p) for p in v.value.placements]
            for v in model.optimizer.variables
            if len(v.shape) > 0
        },
    )
    keras.distribution.set_distribution(None)
    for mode in ("single", "dp", "tp", "2d"):
        run_remat(mode, mesh_shape)
    worker_utils.report()


def main():
    args = sys.argv[1:]
    if args[0] == "--print-layouts":
        print_layouts(
            tuple(int(s) for s in args[1].split(",")), "--apply" in args
        )
    else:
        run_distributed(tuple(int(s) for s in args[0].split(",")))


if __name__ == "__main__":
    main()
