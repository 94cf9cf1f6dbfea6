"""Train, test and predict steps of the torch trainer under a distribution.

`TorchTrainer.make_train_function`, `make_test_function` and
`make_predict_function` pass the step function they build to
`distribute_step_function`, which returns a `DistributedStepFunction`:

- Under a distribution, the step distributes its batch on entry (every
  array leaf becomes a DTensor laid out by `Distribution.get_data_layout`)
  and runs in `distribution_lib.replicate_created_tensors`, so that the
  tensors it creates from Python values are replicated DTensors. Without a
  distribution it runs as upstream's.
- Under a distribution, an eager train step (of a model that does not
  override `train_step`) is the copy of upstream's `train_step` in
  `train_step_copies`, which clears and reads the gradients with that
  mode suspended (`outside_step_mode`). A keras whose `train_step` has no
  copy there runs its own, as a model's own, with a warning naming the
  version.
- Under a distribution with `jit_compile=True`, the step is compiled by
  `compiled_step_backend.compile_step_function` instead of upstream's
  plain `torch.compile`.

Collectives: the steps issue those of `distribution_lib.distribute_data`
and of the step itself, on the thread that runs the step; building a step
function issues none.
"""

import torch

from keras.src.backend.torch import compiled_step_backend
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import reducer
from keras.src.backend.torch import train_step_copies
from keras.src.backend.torch.train_step_copies import outside_step_mode
from keras.src.distribution import distribution_lib as keras_distribution_lib

STEP_KINDS = ("train", "test", "predict")


class DistributedStepFunction:
    """A step function that distributes its batch on entry.

    Under a distribution, `step_fn` receives the batch with every array
    leaf distributed by `distribution_lib.distribute_data`, and runs in
    `distribution_lib.replicate_created_tensors` (in the mode Dynamo
    traces whole when `step_fn` is compiled). Without a distribution,
    `step_fn` runs as it is. A step that raises leaves no gradient
    reduction pending (`reducer.discard_pending`): the next step,
    after the caller caught the error, trains as if it were the first.

    Args:
        step_fn: the step function, taking the batch.
        compiled_for_distribution: whether `step_fn` was compiled by
            `compiled_step_backend.compile_step_function`.
        distributed_step_fn: the function run instead of `step_fn` under
            a distribution, if any.
    """

    def __init__(
        self,
        step_fn,
        compiled_for_distribution=False,
        distributed_step_fn=None,
    ):
        self.step_fn = step_fn
        self.compiled_for_distribution = compiled_for_distribution
        self.distributed_step_fn = distributed_step_fn or step_fn

    def __call__(self, data):
        distribution = keras_distribution_lib.distribution()
        if distribution is None:
            return self.step_fn(data)
        data = distribution_lib.distribute_data(data, distribution)
        with distribution_lib.replicate_created_tensors(
            distribution.device_mesh, compiled=self.compiled_for_distribution
        ):
            try:
                return self.distributed_step_fn(data)
            except BaseException:
                # A backward pass that raised leaves its buckets behind.
                reducer.discard_pending()
                raise


def distribute_step_function(trainer, kind):
    """Makes `trainer`'s step function of `kind` run under a distribution.

    Called after upstream's `make_{kind}_function` set
    `trainer.{kind}_function`. Under a distribution it first checks that
    `trainer`'s variables are distributed. It then wraps that function in
    a `DistributedStepFunction`, which runs it without a distribution and
    `eager_step_on_data` under one, or, under a distribution with
    `jit_compile=True`, replaces it by the step compiled by
    `compiled_step_backend`. A function this already returned is kept,
    unless it is not compiled and a compiled one is now needed.

    Args:
        trainer: the `TorchTrainer` (a compiled model).
        kind: one of `STEP_KINDS`.

    Returns:
        The step function, also set as `trainer.{kind}_function`.
    """
    attribute = f"{kind}_function"
    distribution = keras_distribution_lib.distribution()
    if distribution is not None:
        distribution_lib.check_model_distributed(trainer, distribution)
    step_function = getattr(trainer, attribute)
    compile_step = distribution is not None and trainer._should_torch_compile()
    if isinstance(step_function, DistributedStepFunction) and (
        step_function.compiled_for_distribution or not compile_step
    ):
        return step_function
    if compile_step:
        step_function = DistributedStepFunction(
            compiled_step_on_data(trainer, kind),
            compiled_for_distribution=True,
        )
    elif step_function is not None:
        step_function = DistributedStepFunction(
            step_function,
            distributed_step_fn=eager_step_on_data(trainer, kind),
        )
    setattr(trainer, attribute, step_function)
    return step_function


def step_on_data(trainer, kind, eager=False):
    """The function of one batch that the distributed step of `kind` runs.

    As upstream's `one_step_on_data`: it takes the batch as the data
    iterator yields it (a 1-tuple) and runs `trainer`'s step, test and
    predict steps under `torch.no_grad()`. The train step is
    `train_step_copies.train_step_with_detached_predictions` unless the
    model overrides `train_step`.

    Args:
        trainer: the `TorchTrainer`.
        kind: one of `STEP_KINDS`.
        eager: whether the step runs eagerly (else it is compiled).

    Returns:
        A function of the batch.
    """
    if kind == "train":
        if _overrides_train_step(trainer):
            step = trainer.train_step
        else:
            step = train_step_copies.train_step_with_detached_predictions(
                trainer, eager=eager
            )
        return lambda data: step(data[0])
    step = getattr(trainer, f"{kind}_step")

    def one_step_on_data(data):
        with torch.no_grad():
            return step(data[0])

    return one_step_on_data


def compiled_step_on_data(trainer, kind):
    """`step_on_data(trainer, kind)` compiled by
    `compiled_step_backend.compile_step_function`.

    Keras's train step clears the gradients (`zero_grad()`) before it
    computes new ones, and Dynamo guards the compiled step on what that
    found: no gradients at the first step, the last step's at the next,
    so the whole step was compiled a second time at the second step. After
    each compiled run of Keras's own train step (not of a model's own
    `train_step`, which may keep gradients from step to step), the
    gradients are cleared outside the compiled code instead, and the first
    compile's guard holds at every step. Cleared gradients are what the
    next step's `zero_grad()` would leave, and the optimizer has applied
    them already.

    Args:
        trainer: the `TorchTrainer`.
        kind: one of `STEP_KINDS`.

    Returns:
        A function of the batch.
    """
    compiled = compiled_step_backend.compile_step_function(
        step_on_data(trainer, kind)
    )
    if kind != "train" or _overrides_train_step(trainer):
        return compiled

    def step_then_clear_gradients(data):
        logs = compiled(data)
        outside_step_mode(trainer.zero_grad)
        return logs

    return step_then_clear_gradients


def eager_step_on_data(trainer, kind):
    """The function of one batch an eager step of `kind` runs under a
    distribution: `step_on_data(trainer, kind, eager=True)` for a train
    step, None (upstream's step function) for the others."""
    if kind != "train":
        return None
    return step_on_data(trainer, kind, eager=True)


def _overrides_train_step(trainer):
    """Whether `trainer`'s class overrides `TorchTrainer.train_step`."""
    # Imported here: `trainer.py` imports this module.
    from keras.src.backend.torch.trainer import TorchTrainer

    return type(trainer).train_step is not TorchTrainer.train_step
