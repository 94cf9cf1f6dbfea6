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
  `TRAIN_STEP_COPIES`, which clears and reads the gradients with that
  mode suspended (`outside_step_mode`): they are attribute reads and
  writes of every variable, which the mode would otherwise intercept one
  by one, and create no tensor. A keras whose `train_step` has no copy
  there runs its own, as a model's own, with a warning naming the
  version.
- Under a distribution with `jit_compile=True`, the step is compiled with
  `distributed_step_backend` instead of upstream's plain `torch.compile`.

Upstream compiles each whole step function with `torch.compile`. Dynamo
splits the train step at `loss.backward()`, and keras layers break graphs
too (e.g. `MultiHeadAttention` at `SDPAParams`). With DTensor values that
fails or computes wrong numbers in four ways, which the compiled steps
made here avoid while DTensor still does all the math:

1. Missing tangents (pytorch#172556). The graph that ends at
   `loss.backward()` returns the loss and the predictions `y_pred`, which
   only `compute_metrics` reads afterwards. Both require gradients, but
   backward starts from the loss alone, so autograd passes a plain zero
   tensor as the gradient of `y_pred`, where the compiled backward expects
   a DTensor: "Expected a DTensor tangent but got a plain Tensor (tangent
   index: 1)". The compile backend ties the differentiable DTensor outputs
   of each compiled graph together through one autograd node, which gives
   an output that backward does not reach a zero DTensor gradient, so any
   train step (a model's own included) can call `loss.backward()`.
   The train step used for upstream's `train_step` also detaches `y_pred`
   before backward, which spares the backward pass that zero gradient.
2. Aliased outputs (pytorch#184002). A graph split inside a layer returns
   several views of one tensor (e.g. attention's query and its transpose);
   AOT autograd rebuilds such outputs with `as_strided`, which DTensor
   rejects. The compile backend clones graph outputs that share storage
   with another output or an input.
3. Backward under Dynamo. `loss.backward()` called from compiled code runs
   with Dynamo's frame hook active, so the Python code that backward
   calls (DTensor's `__tensor_unflatten__`, gradient hooks) gets traced,
   and that failed. Backward is called through `torch.compiler.disable`:
   it still runs the compiled backward graphs; only its Python glue (and
   the gradient reduction hooks) runs eagerly.
4. Wrong numbers from the AOT autograd cache. Its key is computed from the
   Dynamo graph and its inputs' metadata; for a DTensor input that is the
   mesh's ranks, layout and dim names, but not the names of the mesh's
   process groups, which the collectives of the lowered graph hard-code
   (groups are named in the order a process creates them). An entry left
   by an earlier run that created its groups in another order (other
   meshes, other code versions) then all-reduces over the wrong group:
   ModelParallel losses were off by up to 26% from the first step, and
   `scripts/torch_aot_cache_group_names.py` reproduces it in a few lines
   of torch. Inductor's own cache is keyed on the lowered graph, names
   included, and is right. The backend adds what the key misses
   (`ProcessGroupCacheKey`): this process's rank, the name and ranks of
   each of its process groups, and the sources of this backend, whose
   sharding rules DTensor's lowering follows. Both caches' keys also
   pickled each input mesh's cached `hash()`, which changes from run to
   run, so graphs with a mesh input never hit; the backend pickles meshes
   without it (`device_meshes_pickled_without_hash`).

Shapes are static (`dynamic=False`): with automatic dynamic shapes,
tracing the transformer's graphs under DTensor ended in a RecursionError.
A compiled train step of Keras's own clears the gradients after each run
(`compiled_step_on_data`), so that its second step is not compiled again.

Collectives: the steps issue those of `distribution_lib.distribute_data`
and of the step itself, on the thread that runs the step; building a step
function issues none.
"""

import contextlib
import copyreg
import functools
import glob
import hashlib
import inspect
import os
import warnings

import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree

from keras.src import tree
from keras.src.backend.torch import batch_local
from keras.src.backend.torch import batch_reductions
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch import gradient_buckets
from keras.src.distribution import distribution_lib as keras_distribution_lib
from keras.src.trainers.data_adapters import data_adapter_utils

STEP_KINDS = ("train", "test", "predict")

# SHA-256 of `inspect.getsource(TorchTrainer.train_step)` in keras 3.15.1,
# whose copy is `TRAIN_STEP_COPIES`' first entry. Where the installed
# source has no copy, the installed step runs, with a warning
# (`distributed_trainer_test` fails there).
UPSTREAM_TRAIN_STEP_SHA256 = (
    "a638d4455d8fced660adaffa6b4240ed0c28f8bd1832684b245466ba7f1694d0"
)


class DistributedStepFunction:
    """A step function that distributes its batch on entry.

    Under a distribution, `step_fn` receives the batch with every array
    leaf distributed by `distribution_lib.distribute_data`, and runs in
    `distribution_lib.replicate_created_tensors` (in the mode Dynamo
    traces whole when `step_fn` is compiled). Without a distribution,
    `step_fn` runs as it is. A step that raises leaves no gradient
    reduction pending (`gradient_buckets.discard_pending`): the next step,
    after the caller caught the error, trains as if it were the first.

    Args:
        step_fn: the step function, taking the batch.
        compiled_for_distribution: whether `step_fn` was compiled by
            `compile_step_function` (with `distributed_step_backend`).
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
                gradient_buckets.discard_pending()
                raise


def distribute_step_function(trainer, kind):
    """Makes `trainer`'s step function of `kind` run under a distribution.

    Called after upstream's `make_{kind}_function` set
    `trainer.{kind}_function`. Under a distribution it first checks that
    `trainer`'s variables are distributed. It then wraps that function in
    a `DistributedStepFunction`, which runs it without a distribution and
    `eager_step_on_data` under one, or, under a distribution with
    `jit_compile=True`, replaces it by the step compiled with
    `distributed_step_backend`. A function this already returned is kept,
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
    `train_step_with_detached_predictions` unless the model overrides
    `train_step`.

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
            step = train_step_with_detached_predictions(trainer, eager=eager)
        return lambda data: step(data[0])
    step = getattr(trainer, f"{kind}_step")

    def one_step_on_data(data):
        with torch.no_grad():
            return step(data[0])

    return one_step_on_data


def compiled_step_on_data(trainer, kind):
    """`step_on_data(trainer, kind)` compiled by `compile_step_function`.

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
    compiled = compile_step_function(step_on_data(trainer, kind))
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

    A compiled step calls `loss.backward()` through
    `torch.compiler.disable` and keeps its mode throughout; an eager step
    calls backward directly and clears and reads the gradients with
    `outside_step_mode`.
    """
    if eager:
        return torch.Tensor.backward, outside_step_mode
    return torch.compiler.disable(torch.Tensor.backward), _call


def _gradient_list(trainable_weights):
    """The gradients of `trainable_weights`, as upstream lists them."""
    return [v.value.grad for v in trainable_weights]


def _overrides_train_step(trainer):
    """Whether `trainer`'s class overrides `TorchTrainer.train_step`."""
    # Imported here: `trainer.py` imports this module.
    from keras.src.backend.torch.trainer import TorchTrainer

    return type(trainer).train_step is not TorchTrainer.train_step


def train_step_with_detached_predictions(trainer, eager=False):
    """`TorchTrainer.train_step` for `trainer`, with `y_pred` detached
    before the gradients and the gradients computed outside Dynamo.

    It is the copy, in `TRAIN_STEP_COPIES`, of the installed keras's
    `train_step`, with three changes: no narrower edit can make them,
    since they act on local variables of that one function (`y_pred`
    between the loss and the gradients, `loss.backward()`, and the loss
    between its computation and the loss tracker). The computation is
    upstream's, with the same values: the metrics read the same
    predictions, without their autograd history; the loss is computed in
    `batch_reductions.means_reduced_with_gradients`, reduced in the
    gradients' last bucket (`gradient_buckets.reduced_with_gradients`),
    and the loss tracker updated with it after the optimizer, where
    upstream updates it before backward: a DataParallel step then issues
    no collective of the loss's own. An eager step
    (`eager=True`) also clears and lists the gradients with the step's
    torch function mode suspended (`outside_step_mode`), and runs in
    `batch_local.accumulating_into_variables`: its `loss.backward()`
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
        with batch_local.accumulating_into_variables():
            return step(data)

    return accumulating_step


@functools.cache
def installed_train_step_sha256():
    """SHA-256 of the installed keras's `TorchTrainer.train_step` source."""
    # Imported here: `trainer.py` imports this module.
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
    (`gradient_buckets.reduced_with_gradients`).

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
        carried = gradient_buckets.reduced_with_gradients(loss)
    with carried as rider:
        if trainer.optimizer is not None:
            loss = trainer.optimizer.scale_loss(loss)
        y_pred = _pytree.tree_map_only(
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
# supports -> the copy of that `train_step`.
TRAIN_STEP_COPIES = {
    UPSTREAM_TRAIN_STEP_SHA256: train_step_copy_3_15,
    # keras-nightly 3.16.0.dev2026102704
    "5a70c2e70526d53a0b29bbf487867753220ef5b64144102f1f9d437d4f0e63e0": (
        train_step_copy_3_16_dev
    ),
}


def compile_step_function(step_fn):
    """Compiles `step_fn` with `distributed_step_backend`, static shapes.

    Args:
        step_fn: a function of the batch.

    Returns:
        The compiled function.
    """
    return torch.compile(
        step_fn, backend=distributed_step_backend, dynamic=False
    )


def distributed_step_backend(graph_module, example_inputs):
    """The `torch.compile` backend of steps under a distribution.

    Inductor (upstream's default) with its AOT autograd cache keyed by
    `aot_autograd_cache_keyed_by_process_groups` and its cache keys made
    the same in every run by `device_meshes_pickled_without_hash` (and,
    for backward graphs compiled later, by
    `compile_with_meshes_pickled_without_hash`), after
    `clone_aliased_dtensor_outputs`, with the outputs of each call tied by
    `tie_differentiable_dtensor_outputs`.

    Args:
        graph_module: the Dynamo graph.
        example_inputs: its example inputs.

    Returns:
        The compiled function of the graph's inputs.
    """
    from torch._dynamo.backends.registry import lookup_backend

    clone_aliased_dtensor_outputs(graph_module)
    with (
        aot_autograd_cache_keyed_by_process_groups(),
        device_meshes_pickled_without_hash(),
    ):
        compiled = lookup_backend("inductor")(
            graph_module,
            example_inputs,
            inner_compile=compile_with_meshes_pickled_without_hash,
        )

    def run_compiled(*args):
        return tie_differentiable_dtensor_outputs(compiled(*args))

    return run_compiled


@contextlib.contextmanager
def aot_autograd_cache_keyed_by_process_groups():
    """Inside, inductor's caches are keyed by `ProcessGroupCacheKey` too.

    The key goes in through inductor's `post_grad_custom_post_pass`, whose
    `uuid()` both of inductor's cache keys include: `ProcessGroupCacheKey`
    takes that slot and runs the pass configured there, if any. A plain
    function configured there cannot carry a key: the AOT autograd cache
    is then off inside.
    """
    configured = inductor_config.post_grad_custom_post_pass
    if configured is not None and not isinstance(configured, CustomGraphPass):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield
        return
    keyed = ProcessGroupCacheKey(configured)
    with inductor_config.patch(post_grad_custom_post_pass=keyed):
        yield


@contextlib.contextmanager
def device_meshes_pickled_without_hash():
    """Inside, a `DeviceMesh` pickles without the `hash()` it caches.

    Inductor's and AOT autograd's cache keys pickle the meshes a graph
    takes as inputs, and a mesh pickles its `__dict__`, where it caches its
    `hash()` once hashed. That hash differs from one process to the next
    (it hashes strings, randomized per process, and a layout object), so
    such a graph had a new key in every run and a second run compiled it
    again (`scripts/torch_cache_device_mesh_hash.py`). Everything the hash
    is computed from is still pickled; unpickling computes it again.
    """
    previous = copyreg.dispatch_table.get(DeviceMesh)
    copyreg.pickle(DeviceMesh, _reduce_mesh_without_hash)
    try:
        yield
    finally:
        if previous is None:
            del copyreg.dispatch_table[DeviceMesh]
        else:
            copyreg.dispatch_table[DeviceMesh] = previous


def compile_with_meshes_pickled_without_hash(*args, **kwargs):
    """Inductor's `compile_fx_inner`, in `device_meshes_pickled_without_hash`.

    AOT autograd compiles a graph's backward when backward first runs,
    after the backend has returned; inductor keys its cache entry of that
    graph in here.
    """
    from torch._inductor import compile_fx

    with device_meshes_pickled_without_hash():
        return compile_fx.compile_fx_inner(*args, **kwargs)


def _reduce_mesh_without_hash(mesh):
    """The pickle reduction of `mesh`: torch's, but for `_hash`.

    As by default, unpickling makes the mesh, then sets its state
    (`DeviceMesh.__setstate__`): it needs nothing from this module.
    """
    state = mesh.__getstate__()
    state.pop("_hash", None)
    return copyreg.__newobj__, (type(mesh),), state


class ProcessGroupCacheKey(CustomGraphPass):
    """A post-grad pass that only carries the cache key AOT autograd misses.

    Running it runs the pass it wraps, if any. Its `uuid()` is that pass's
    with `process_group_cache_key()` and `backend_sources_digest()`, or
    None (no caching, as inductor reads it) where the wrapped pass's is.

    Args:
        configured: the `CustomGraphPass` configured before, or None.
    """

    def __init__(self, configured=None):
        self.configured = configured

    def __call__(self, graph):
        if self.configured is not None:
            self.configured(graph)

    def uuid(self):
        configured = None
        if self.configured is not None:
            configured = self.configured.uuid()
            if configured is None:
                return None
        return (
            configured,
            process_group_cache_key(),
            backend_sources_digest(),
        )


def process_group_cache_key():
    """This process's rank and every process group it knows, as
    `(rank, ((group name, global ranks in group-rank order), ...))`.

    A graph lowered here refers to its collectives' groups by name; a
    cached graph is right in another process only where each name stands
    for the same ranks in the same order. Reads the registry of
    `torch.distributed`; issues no collective.
    """
    if not dist.is_initialized():
        return (None, ())
    world = dist.distributed_c10d._world
    groups = []
    for group, name in world.pg_names.items():
        ranks = world.pg_group_ranks.get(group, {})
        in_order = tuple(sorted(ranks, key=ranks.get))
        groups.append((name, in_order))
    return (dist.get_rank(), tuple(sorted(groups)))


@functools.cache
def backend_sources_digest():
    """SHA-256 of this backend's module sources (tests aside).

    Among them the sharding rules DTensor lowers graphs with
    (`sharding_rules`): a cached graph lowered under other rules is stale.
    """
    digest = hashlib.sha256()
    folder = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        if path.endswith("_test.py"):
            continue
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()


def _storage_of(node):
    """The storage behind a graph node's example value (a DTensor's local
    tensor), or None for non-tensors."""
    from torch.multiprocessing.reductions import StorageWeakRef

    value = node.meta.get("example_value")
    if isinstance(value, DTensor):
        value = value._local_tensor
    if not isinstance(value, torch.Tensor):
        return None
    return StorageWeakRef(value.untyped_storage())


def _fake_clone(value):
    """Clones a graph's example DTensor in its fake tensor mode."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    with maybe_get_fake_mode(value._local_tensor):
        return value.clone()


def _storage_users(graph, outputs):
    """How many inputs and computed outputs of `graph` use each storage."""
    users = {}
    nodes = [n for n in graph.nodes if n.op == "placeholder"] + [
        n
        for n in outputs
        if isinstance(n, torch.fx.Node) and n.op != "placeholder"
    ]
    for node in nodes:
        storage = _storage_of(node)
        if storage is not None:
            users[storage] = users.get(storage, 0) + 1
    return users


def _is_aliased_dtensor(node, users):
    """Whether an output node is a computed DTensor sharing its storage."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op != "placeholder"
        and isinstance(node.meta.get("example_value"), DTensor)
        and users.get(_storage_of(node), 0) >= 2
    )


def clone_aliased_dtensor_outputs(graph_module):
    """Makes every DTensor output of a Dynamo graph own its storage.

    An output that shares storage with another output or with an input
    (and is not that input itself) is replaced by its clone.

    Args:
        graph_module: the Dynamo graph, changed in place.

    Returns:
        The indices of the outputs replaced.
    """
    graph = graph_module.graph
    output_node = graph.output_node()
    outputs = list(output_node.args[0])
    users = _storage_users(graph, outputs)
    replaced = []
    for index, node in enumerate(outputs):
        if not _is_aliased_dtensor(node, users):
            continue
        with graph.inserting_before(output_node):
            clone = graph.call_method("clone", (node,))
        clone.meta = dict(node.meta)
        clone.meta["example_value"] = _fake_clone(node.meta["example_value"])
        outputs[index] = clone
        replaced.append(index)
    if replaced:
        output_node.args = (type(output_node.args[0])(outputs),)
        graph.lint()
        graph_module.recompile()
    return replaced


def _dtensor_metadata(value):
    """What `_zero_like_dtensor` needs to rebuild a DTensor like `value`."""
    return (
        value.device_mesh,
        value.placements,
        value.shape,
        value.stride(),
        value._local_tensor.shape,
        value.dtype,
        value.device,
    )


def _zero_like_dtensor(metadata):
    """A zero DTensor with the metadata `_dtensor_metadata` kept."""
    mesh, placements, shape, stride, local_shape, dtype, device = metadata
    return DTensor.from_local(
        torch.zeros(local_shape, dtype=dtype, device=device),
        mesh,
        placements,
        run_check=False,
        shape=shape,
        stride=stride,
    )


class _TieDifferentiableOutputs(torch.autograd.Function):
    """Identity on DTensors; a missing gradient becomes a zero DTensor.

    Each output is a new DTensor over the same local tensor, not a view:
    autograd forbids writing in place into one of several views a
    function returns, and the eager code after a graph break may do so
    (keras-hub's Gemma scales its queries with `q *= ...`).
    """

    @staticmethod
    def forward(ctx, *outputs):
        ctx.set_materialize_grads(False)
        ctx.output_metadata = [_dtensor_metadata(o) for o in outputs]
        return tuple(
            dtensor_layouts.rewrapped(output, output.to_local())
            for output in outputs
        )

    @staticmethod
    def backward(ctx, *grads):
        return tuple(
            _zero_like_dtensor(metadata) if grad is None else grad
            for grad, metadata in zip(grads, ctx.output_metadata)
        )


def tie_differentiable_dtensor_outputs(outputs):
    """Passes a compiled graph's differentiable DTensor outputs through one
    autograd node.

    Backward then reaches the compiled graph through that node, which gives
    every output that backward did not reach a zero DTensor gradient,
    where autograd would pass the compiled backward a plain zero tensor
    (pytorch#172556).

    Args:
        outputs: the outputs of a compiled graph (a tuple or list).

    Returns:
        `outputs`, with its differentiable DTensors replaced by tied views
        when there are at least two; other outputs as they are.
    """
    positions = [
        i
        for i, output in enumerate(outputs)
        if isinstance(output, DTensor) and output.requires_grad
    ]
    if len(positions) < 2:
        return outputs
    tied = _TieDifferentiableOutputs.apply(*(outputs[i] for i in positions))
    result = list(outputs)
    for i, output in zip(positions, tied):
        result[i] = output
    return tuple(result) if isinstance(outputs, tuple) else result
