"""Upstream's `train_step`, copied per keras version, for distributed steps.

Under a distribution, the train step of a model that does not override
`train_step` is `train_step_with_detached_predictions`: the copy, in
`TRAIN_STEP_COPIES`, of the installed keras's `TorchTrainer.train_step`,
picked by the SHA-256 of that function's source
(`installed_train_step_sha256`). A copy computes upstream's values, with
changes that act on local variables of that one function, which no
narrower edit can make: `y_pred` is detached before the gradients, a
compiled step calls `loss.backward()` outside Dynamo, the loss is reduced
with the gradients' last bucket, and an eager step reads the gradients
outside the step's torch function mode (`outside_step_mode`).

A keras whose `train_step` has no copy here runs its own step as it is,
as it runs a model's own, with a warning naming the version
(`unknown_train_step_message`); `train_step_copies_test` fails there.

Collectives: those of the step itself (the loss, the gradients), issued
on the thread that runs it; building a step issues none.
"""

import contextlib
import functools
import hashlib
import inspect
import warnings

import torch

from keras.src import tree
from keras.src.backend.torch import batch_reductions
from keras.src.backend.torch import bucket_riders
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import torch_runtime
from keras.src.trainers.data_adapters import data_adapter_utils

# SHA-256 of `inspect.getsource(TorchTrainer.train_step)` in keras 3.15.1,
# whose copy is `TRAIN_STEP_COPIES`' first entry.
UPSTREAM_TRAIN_STEP_SHA256 = (
    "a638d4455d8fced660adaffa6b4240ed0c28f8bd1832684b245466ba7f1694d0"
)


def train_step_with_detached_predictions(trainer, eager=False):
    """`TorchTrainer.train_step` for `trainer`, with `y_pred` detached
    before the gradients and the gradients computed outside Dynamo.

    It is the copy, in `TRAIN_STEP_COPIES`, of the installed keras's
    `train_step`. The computation is upstream's, with the same values:
    the metrics read the same predictions, without their autograd
    history; the loss is computed in
    `batch_reductions.means_reduced_with_gradients`, reduced in the
    gradients' last bucket (`bucket_riders.reduced_with_gradients`),
    and the loss tracker updated with it after the optimizer, where
    upstream updates it before backward: a DataParallel step then issues
    no collective of the loss's own. An eager step (`eager=True`) also
    clears and lists the gradients with the step's torch function mode
    suspended (`outside_step_mode`), and runs in
    `local_call_state.accumulating_into_variables`: its `loss.backward()`
    accumulates into the variables, so layers running on local tensors
    read them as gradient leaves, whose gradients are reduced as soon as
    each is complete.

    Args:
        trainer: the `TorchTrainer`.
        eager: whether the step runs eagerly (else it is compiled).

    Returns:
        A function of the unpacked batch, as `trainer.train_step`.
    """
    copy = TRAIN_STEP_COPIES.get(installed_train_step_sha256())
    if copy is None:
        # Another version's copy could differ from what this keras's step
        # does; the installed step runs as it is, as a model's own would.
        warnings.warn(unknown_train_step_message(), stacklevel=2)
        return trainer.train_step
    step = copy(trainer, eager=eager)
    if not eager:
        return step

    def accumulating_step(data):
        with local_call_state.accumulating_into_variables():
            return step(data)

    return accumulating_step


@functools.cache
def installed_train_step_sha256():
    """SHA-256 of the installed keras's `TorchTrainer.train_step` source."""
    # Imported here: `trainer.py` imports the trainer's modules.
    from keras.src.backend.torch.trainer import TorchTrainer

    source = inspect.getsource(TorchTrainer.train_step)
    return hashlib.sha256(source.encode()).hexdigest()


def unknown_train_step_message():
    """The warning for a keras whose `train_step` has no copy here."""
    import keras

    return (
        f"keras {keras.__version__}'s `TorchTrainer.train_step` is not one "
        "keras-dtensor has a copy of (its source's SHA-256 is "
        f"{installed_train_step_sha256()}). Distributed training runs it "
        "as it is, as it runs a model's own `train_step`: the values are "
        "the same, but the loss is all-reduced by itself instead of with "
        "the last gradients, and the metrics' inputs keep their autograd "
        "history through backward."
    )


def outside_step_mode(function, *args):
    """Calls `function(*args)` with the step's torch function mode
    suspended, where it is the innermost mode.

    For code that only reads and writes attributes of tensors (the
    variables' gradients), which the mode would intercept call by call and
    pass through unchanged.
    """
    if created_tensors.current_mode() is None:
        return function(*args)
    with created_tensors.suspended():
        return function(*args)


def _call(function, *args):
    """Calls `function(*args)`: `outside_step_mode` of a compiled step,
    whose mode Dynamo traces."""
    return function(*args)


def _step_helpers(eager):
    """`(backward, outside_mode)` of a train step copy.

    A compiled step keeps its mode throughout; an eager step calls
    backward directly and clears and reads the gradients with
    `outside_step_mode`.
    """
    if eager:
        return torch.Tensor.backward, outside_step_mode
    # `loss.backward()` called from compiled code ran with Dynamo's frame
    # hook active, so the Python code backward calls (DTensor's
    # `__tensor_unflatten__`, gradient hooks) got traced, and that failed.
    # Through `torch.compiler.disable`, backward still runs the compiled
    # backward graphs; only its Python glue (and the gradient reduction
    # hooks) runs eagerly.
    return torch.compiler.disable(torch.Tensor.backward), _call


def _gradient_list(trainable_weights):
    """The gradients of `trainable_weights`, as upstream lists them."""
    return [v.value.grad for v in trainable_weights]


def train_step_copy_3_15(trainer, eager=False):
    """Keras 3.15.1's `train_step` for `trainer`, `y_pred` detached before
    backward, with `_step_helpers(eager)`' backward and gradient
    access."""
    backward, outside_mode = _step_helpers(eager)

    def gradients_of(loss, trainable_weights):
        backward(loss)
        return outside_mode(_gradient_list, trainable_weights)

    def train_step(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        if trainer._call_has_training_arg:
            y_pred = trainer(x, training=True)
        else:
            y_pred = trainer(x)
        outside_mode(trainer.zero_grad)
        tracked, y_pred = _loss_then_gradients(
            trainer, x, y, y_pred, sample_weight, gradients_of
        )
        trainer._loss_tracker.update_state(
            tracked,
            sample_weight=next(
                i for i in tree.flatten(x) if i is not None
            ).shape[0],
        )
        return trainer.compute_metrics(
            x, y, y_pred, sample_weight=sample_weight
        )

    return train_step


def train_step_copy_3_16_dev(trainer, eager=False):
    """keras-nightly 3.16.0.dev2026102704's `train_step` for `trainer`,
    `y_pred` detached after the loss, with `_step_helpers(eager)`'
    backward and gradient access, and `torch.autograd.grad` (which that
    keras calls for a compiled step without DDP) called through
    `torch.compiler.disable`."""
    backward, outside_mode = _step_helpers(eager)
    grad = torch.compiler.disable(torch.autograd.grad)

    def gradients_of(loss, trainable_weights):
        if (
            not trainer.run_eagerly
            and trainer.jit_compile
            and trainer.ddp_model is None
        ):
            return _gradients_by_grad(grad, loss, trainable_weights)
        backward(loss)
        return outside_mode(_gradient_list, trainable_weights)

    def train_step(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        model = trainer.ddp_model or trainer
        if trainer._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        outside_mode(model.zero_grad)
        tracked, y_pred = _loss_then_gradients(
            trainer, x, y, y_pred, sample_weight, gradients_of
        )
        trainer._loss_tracker.update_state(
            tracked.detach() if isinstance(tracked, torch.Tensor) else tracked,
            sample_weight=(
                x.shape[0]
                if isinstance(x, torch.Tensor)
                else next(i for i in tree.flatten(x) if i is not None).shape[0]
            ),
        )
        return trainer.compute_metrics(
            x, y, y_pred, sample_weight=sample_weight
        )

    return train_step


def _gradients_by_grad(grad, loss, trainable_weights):
    """keras-nightly's gradients of a compiled step: `torch.autograd.grad`
    of the loss for the weights that require gradients, None for others."""
    trainable_tensors = [v.value for v in trainable_weights]
    if isinstance(loss, torch.Tensor) and not loss.requires_grad:
        return [None] * len(trainable_weights)
    if all(t.requires_grad for t in trainable_tensors):
        return grad(loss, trainable_tensors, allow_unused=True)
    inputs = [t for t in trainable_tensors if t.requires_grad]
    grads = iter(grad(loss, inputs, allow_unused=True)) if inputs else iter(())
    return [next(grads) if t.requires_grad else None for t in trainable_tensors]


def _loss_then_gradients(trainer, x, y, y_pred, sample_weight, gradients_of):
    """The middle of upstream's `train_step`, as each copy has it, with the
    loss reduced in the gradients' last bucket.

    The loss is computed in `batch_reductions.means_reduced_with_gradients`
    (a mean over the batch is left partial), scaled by the optimizer, and
    its gradients applied (`_apply_gradients`) with `y_pred` detached;
    the gradient buckets sent when backward ends reduce it too
    (`bucket_riders.reduced_with_gradients`).

    A compiled step (whose losses are reduced on DTensors, not locally:
    nothing is left partial) computes them as upstream does, without these
    contexts in its graph.

    Returns:
        `(loss, y_pred)`: the loss as the loss tracker reads it (reduced,
        or still partial where no bucket carried it: the tracker's update
        then all-reduces it) and the detached predictions.
    """
    compiled = torch.compiler.is_compiling()
    if compiled:
        means_left_partial = contextlib.nullcontext()
    else:
        means_left_partial = batch_reductions.means_reduced_with_gradients()
    with means_left_partial:
        loss = trainer._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    tracked = loss
    if compiled:
        carried = contextlib.nullcontext()
    else:
        carried = bucket_riders.reduced_with_gradients(loss)
    with carried as rider:
        if trainer.optimizer is not None:
            loss = trainer.optimizer.scale_loss(loss)
        # Only `compute_metrics` reads `y_pred` after backward. Detached
        # before backward, it is no differentiable output of the compiled
        # graph that ends at `loss.backward()`, which spares that graph's
        # backward a zero gradient for it (pytorch#172556; the compile
        # backend gives one to any output backward does not reach,
        # `compiled_graph_outputs`).
        y_pred = torch_runtime.pytree.tree_map_only(
            torch.Tensor, torch.Tensor.detach, y_pred
        )
        _apply_gradients(trainer, loss, gradients_of)
    if rider is not None:
        tracked = rider.value()
    return tracked, y_pred


def _apply_gradients(trainer, loss, gradients_of):
    """The end of upstream's `train_step`, as each copy has it: the
    optimizer applies `gradients_of(loss, trainable_weights)`, or a warning
    says the model has no trainable weights."""
    if not trainer.trainable_weights:
        warnings.warn("The model does not have any trainable weights.")
        return
    trainable_weights = trainer.trainable_weights[:]
    gradients = gradients_of(loss, trainable_weights)
    with torch.no_grad():
        trainer.optimizer.apply(gradients, trainable_weights)


# SHA-256 of `inspect.getsource(TorchTrainer.train_step)` in each keras this
# supports -> the copy of that `train_step`. A registry, filled once.
TRAIN_STEP_COPIES = {
    UPSTREAM_TRAIN_STEP_SHA256: train_step_copy_3_15,
    # keras-nightly 3.16.0.dev2026102704
    "5a70c2e70526d53a0b29bbf487867753220ef5b64144102f1f9d437d4f0e63e0": (
        train_step_copy_3_16_dev
    ),
}
