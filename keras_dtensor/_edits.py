"""The post-import edits: what would be changes to upstream keras files.

Each edit is one small function that takes the freshly executed upstream
module and changes it in place. UPSTREAMING.md lists every edit with the
in-tree change it stands for. Edits act only under the torch backend, so
keras on any other backend is exactly upstream keras.

This module is loaded when the mount is armed, at the first `keras` import:
it imports neither torch nor keras at module level.
"""

import functools
import importlib.util
import os
import re
import sys
import types

from keras_dtensor import _keras_hub_edits
from keras_dtensor import _saving_edits

SUPPORTED_KERAS = ("3.15.1", "3.16")  # [minimum, exclusive maximum)
# keras-nightly versions outside that range that this project's whole test
# suite passed on (docs/keras_nightly.md, scripts/nightly.sh).
TESTED_KERAS_NIGHTLY = ("3.16.0.dev2026102704",)
# Measured by scripts/torch_matrix.sh (README, "Supported versions").
SUPPORTED_TORCH = ("2.11", "2.16")  # [minimum, exclusive maximum)


class UnsupportedVersionError(RuntimeError):
    """Raised when keras or torch is outside the supported range."""


def _version_tuple(version):
    """`"2.13.0+cpu"` -> `(2, 13, 0)`; stops at the first non-numeric part."""
    parts = []
    for part in version.split("+")[0].split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.group() != part:
            break
    return tuple(parts)


def _in_range(version, supported):
    """Whether `version` lies in `supported`, a [minimum, maximum) pair."""
    low, high = (_version_tuple(v) for v in supported)
    return low <= _version_tuple(version) < high


def _range_text(name, supported):
    """`("2.11", "2.16")` -> `"torch>=2.11,<2.16"`, as pyproject says it."""
    return f"{name}>={supported[0]},<{supported[1]}"


def keras_version_supported(version):
    """Whether keras `version` is in `SUPPORTED_KERAS` or a tested nightly."""
    return (
        _in_range(version, SUPPORTED_KERAS) or version in TESTED_KERAS_NIGHTLY
    )


def _keras_support_text():
    """The supported keras versions, in words, for the version errors."""
    text = _range_text("keras", SUPPORTED_KERAS)
    if TESTED_KERAS_NIGHTLY:
        nightlies = ", ".join(TESTED_KERAS_NIGHTLY)
        text += f" (or the tested keras-nightly {nightlies})"
    return text


def check_supported_versions(module=None):
    """Fails with one clear error on a keras or torch outside the range."""
    import torch

    from keras.src.version import __version__ as keras_version

    keras_ok = keras_version_supported(keras_version)
    torch_ok = _in_range(torch.__version__, SUPPORTED_TORCH)
    if not (keras_ok and torch_ok):
        raise UnsupportedVersionError(
            f"keras-dtensor supports {_keras_support_text()} "
            f"and {_range_text('torch', SUPPORTED_TORCH)}. "
            f"Found keras=={keras_version} and torch=={torch.__version__}. "
            "Install a supported version, or uninstall keras-dtensor."
        )


def installed_keras_version():
    """The version of the keras being imported, read from its source.

    Reads `keras/src/version.py` of the `keras` package in `sys.modules`
    (or found on `sys.path`) without importing anything: it is called
    while keras itself is being imported. None where it cannot be read.
    """
    keras = sys.modules.get("keras")
    if keras is not None and getattr(keras, "__file__", None):
        folder = os.path.dirname(keras.__file__)
    else:
        spec = importlib.util.find_spec("keras")
        if spec is None or not spec.origin:
            return None
        folder = os.path.dirname(spec.origin)
    try:
        with open(os.path.join(folder, "src", "version.py")) as f:
            source = f.read()
    except OSError:
        return None
    match = re.search(r"^__version__ = [\"']([^\"']+)[\"']", source, re.M)
    return None if match is None else match.group(1)


def check_installed_keras_version():
    """Fails with one clear error on a keras outside the supported range.

    Run by the mount before it serves its first torch backend module, so
    that a keras it was not built for (say an untested 3.16 dev version,
    whose torch backend has a `distribution_lib` of its own) gets this
    error instead of whatever the overlay would meet there. torch is
    checked when `keras.src.backend.torch.core` is imported
    (`check_supported_versions`).
    """
    version = installed_keras_version()
    if version is None or keras_version_supported(version):
        return
    raise UnsupportedVersionError(
        f"keras-dtensor supports {_keras_support_text()}. "
        f"Found keras=={version}. Install a supported version, or uninstall "
        "keras-dtensor."
    )


def _is_torch_backend():
    """Whether keras runs on the torch backend (the edits act only then)."""
    from keras.src.backend.config import backend

    return backend() == "torch"


def distribution_accessor():
    """The edits' one way to read the active distribution.

    It reads what `keras.distribution.distribution()` reads, without that
    function's Python frame: the layer-call edit asks on every layer call.

    Returns:
        A function of no arguments returning the `Distribution`, or None.
    """
    from keras.src.backend.common import global_state

    return functools.partial(global_state.get_global_attribute, "distribution")


def _torch_distribution_lib():
    from keras.src.backend.torch import distribution_lib

    return distribution_lib


def edit_backend_distribution_lib(backend_module):
    """`keras.src.backend.distribution_lib` is the torch module, not None."""
    if _is_torch_backend():
        backend_module.distribution_lib = _torch_distribution_lib()


def edit_distribution_api_binding(module):
    """`keras.distribution` binds the torch `distribution_lib`.

    Needed only when keras was imported before the mount was armed.
    """
    if _is_torch_backend() and module.distribution_lib is None:
        module.distribution_lib = _torch_distribution_lib()


def edit_tensor_layout_multi_axis(module):
    """`TensorLayout` accepts a dimension sharded over several mesh axes.

    As with JAX's `PartitionSpec`, an entry of `axes` may be a tuple of mesh
    axis names, e.g. `(("batch", "model"), None)`.
    """
    if not _is_torch_backend():
        return

    def _validate_axes(self):
        if not self._device_mesh:
            return
        valid_axis_names = set(self._device_mesh.axis_names)
        axis_names = set()
        for entry in self._axes:
            if isinstance(entry, (tuple, list)):
                axis_names.update(entry)
            elif entry is not None:
                axis_names.add(entry)
        if axis_names - valid_axis_names:
            raise ValueError(
                "Invalid axis names for Layout. Valid axis "
                f"names: {valid_axis_names}, Got {axis_names}"
            )

    module.TensorLayout._validate_axes = _validate_axes


def _resolve_variable_layout(variable, distribution):
    """Sets a variable's layout from `distribution` if it has none.

    Returns whether the variable has a layout: an explicit `layout=`
    argument, else the distribution's `get_variable_layout`.
    """
    if variable._layout is None and distribution is not None:
        variable._layout = distribution.get_variable_layout(variable)
    return variable._layout is not None


def edit_variable_initialize(core):
    """Variables are created as DTensor parameters in their layout.

    The layout is an explicit `layout=` argument, else the active
    distribution's `get_variable_layout`; with neither, creation is
    upstream's.
    """
    current_distribution = distribution_accessor()

    upstream_initialize = core.Variable._initialize

    def _initialize(self, value):
        distribution = current_distribution()
        if self._layout is None and distribution is not None:
            # `get_variable_layout` reads the shape, which may not be set yet.
            self._shape = self._validate_shape(value.shape)
        if not _resolve_variable_layout(self, distribution):
            return upstream_initialize(self, value)
        value = core.convert_to_tensor(value, dtype=self._dtype)
        self._value = _torch_distribution_lib().distribute_variable(
            value, self._layout, trainable=self.trainable, path=self.path
        )

    core.Variable._initialize = _initialize


def edit_variable_initialize_shard_by_shard(core):
    """A sharded variable's initializer runs on its shard, not in full.

    Where the layout shards the variable and the initializer splits into
    rows (`sharded_initialization`), each process computes only its shard;
    otherwise the value is computed in full, as upstream does.
    """
    current_distribution = distribution_accessor()

    upstream_initialize_with_initializer = (
        core.Variable._initialize_with_initializer
    )

    def _initialize_with_initializer(self, initializer):
        if _resolve_variable_layout(self, current_distribution()):
            shard = _torch_distribution_lib().initialize_variable_shard(
                initializer, self._shape, self._dtype, self._layout, self.path
            )
            if shard is not None:
                return self._initialize(shard)
        return upstream_initialize_with_initializer(self, initializer)

    core.Variable._initialize_with_initializer = _initialize_with_initializer


def edit_variable_skips_upstream_distribution(core):
    """A later keras's `Variable` distributes itself through upstream's
    own layouts (`_initialize_distributed`); the variable edits here
    replace that path as a whole, so upstream's finds nothing to do.
    Keras 3.15.1 has no such path: nothing to edit there."""
    if not hasattr(core.Variable, "_initialize_distributed"):
        return

    def _initialize_distributed(self, initializer):
        del initializer
        return None

    core.Variable._initialize_distributed = _initialize_distributed


def edit_variable_assign(core):
    """Every assignment to a distributed variable keeps its layout."""
    from torch.distributed.tensor import DTensor

    upstream_direct_assign = core.Variable._direct_assign

    def _direct_assign(self, value):
        if isinstance(self._value, DTensor):
            _torch_distribution_lib().assign_to_variable(self._value, value)
        else:
            upstream_direct_assign(self, value)

    core.Variable._direct_assign = _direct_assign


def edit_variable_repr(core):
    """A distributed variable's repr shows its placements, not its values.

    Printing the values would gather them: a collective that hangs when one
    process prints alone.
    """
    from torch.distributed.tensor import DTensor

    upstream_repr = core.Variable.__repr__

    def __repr__(self):
        value = getattr(self, "_value", None)
        if not isinstance(value, DTensor):
            return upstream_repr(self)
        return (
            f"<Variable path={self.path}, shape={self.shape}, "
            f"dtype={self.dtype}, placements={tuple(value.placements)}, "
            f"local_shape={tuple(value.to_local().shape)}>"
        )

    core.Variable.__repr__ = __repr__


def edit_convert_to_numpy(core):
    """`convert_to_numpy` returns the full value of a DTensor on every rank."""
    from torch.distributed.tensor import DTensor

    upstream_convert_to_numpy = core.convert_to_numpy

    def gather(x):
        return x.full_tensor() if isinstance(x, DTensor) else x

    def convert_to_numpy(x):
        if isinstance(x, (list, tuple)):
            x = type(x)(gather(e) for e in x)
        else:
            x = gather(x)
        return upstream_convert_to_numpy(x)

    core.convert_to_numpy = convert_to_numpy


def edit_compute_output_spec(core):
    """Shape inference replicates the placeholder tensors it creates.

    `compute_output_spec` first runs a function on meta tensors; where that
    fails it runs it on placeholder tensors of ones, which then meet the
    distributed variables. Under a distribution it runs in
    `replicate_created_tensors`, so the placeholders are replicated DTensors
    (they are identical on every process).
    """
    current_distribution = distribution_accessor()

    upstream_compute_output_spec = core.compute_output_spec

    def compute_output_spec(fn, *args, **kwargs):
        distribution = current_distribution()
        if distribution is None:
            return upstream_compute_output_spec(fn, *args, **kwargs)
        with _torch_distribution_lib().replicate_created_tensors(
            distribution.device_mesh
        ):
            return upstream_compute_output_spec(fn, *args, **kwargs)

    core.compute_output_spec = compute_output_spec


def edit_trainer_step_functions(trainer_module):
    """Step functions distribute their batch and compile for DTensor.

    `make_train_function`, `make_test_function` and
    `make_predict_function` pass the step function upstream built to
    `distributed_trainer.distribute_step_function`: under a distribution
    the model must be distributed, the batch is distributed on entry and
    the step runs in `replicate_created_tensors`; with `jit_compile=True`
    the step is compiled with `distributed_step_backend`. Without a
    distribution the step is upstream's.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import distributed_trainer

    trainer_class = trainer_module.TorchTrainer

    def wrap_maker(kind):
        upstream_maker = getattr(trainer_class, f"make_{kind}_function")

        def make_function(self, force=False):
            upstream_maker(self, force=force)
            return distributed_trainer.distribute_step_function(self, kind)

        setattr(trainer_class, f"make_{kind}_function", make_function)

    for kind in distributed_trainer.STEP_KINDS:
        wrap_maker(kind)


def edit_layer_call_runs_batch_local(layer_module):
    """Inside a distributed step, layer calls go through `batch_local`.

    A layer whose first call with a given signature computed each batch
    shard alone (no collective, replicated variables, no random draw or
    state change) runs on local tensors from then on; see
    `keras.src.backend.torch.batch_local`. Outside a distributed step, and
    without a distribution, the call is upstream's.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import batch_local

    upstream_call = layer_module.Layer.__call__
    in_eager_step = _in_eager_distributed_step_check()

    def __call__(self, *args, **kwargs):
        if not in_eager_step():
            return upstream_call(self, *args, **kwargs)
        return batch_local.call_layer(self, upstream_call, args, kwargs)

    layer_module.Layer.__call__ = __call__


def edit_layer_build_replicates_created_tensors(layer_module):
    """Under a distribution, a layer's `build` replicates the tensors it
    creates from Python values.

    Each layer's `build` (upstream's wrapper of it) runs in
    `distribution_lib.replicate_built_tensors`: constants a layer makes
    from its arguments when it is built (`Normalization(mean=...,
    variance=...)`) become replicated DTensors, which the distributed
    tensors of a step meet as one. Without a distribution the build is
    upstream's.
    """
    if not _is_torch_backend():
        return
    current_distribution = distribution_accessor()
    upstream_new = layer_module.Layer.__new__

    def __new__(cls, *args, **kwargs):
        layer = upstream_new(cls, *args, **kwargs)
        layer.build = _build_replicating_created_tensors(
            layer.build, current_distribution
        )
        return layer

    layer_module.Layer.__new__ = staticmethod(__new__)


def _build_replicating_created_tensors(upstream_build, current_distribution):
    """`upstream_build`, run in `replicate_built_tensors` under a
    distribution."""

    @functools.wraps(upstream_build)
    def build(*args, **kwargs):
        distribution = current_distribution()
        if distribution is None:
            return upstream_build(*args, **kwargs)
        with _torch_distribution_lib().replicate_built_tensors(
            distribution.device_mesh
        ):
            return upstream_build(*args, **kwargs)

    return build


def edit_variable_created_as_outside_builds(core):
    """A variable created in a layer's `build` computes its value as
    outside it: the torch function mode of `replicate_built_tensors` is
    off while a variable is created (its initial value is distributed by
    the variable edits, sharded variables shard by shard)."""
    from keras.src.backend.torch import created_tensors

    upstream_init = core.Variable.__init__

    @functools.wraps(upstream_init)
    def __init__(self, *args, **kwargs):
        with created_tensors.creating_variable():
            upstream_init(self, *args, **kwargs)

    core.Variable.__init__ = __init__


def _in_eager_distributed_step_check():
    """A function telling whether a call runs in an eager distributed step.

    That is: a distribution set (checked first, in one Python call: without
    a distribution nothing else is asked; upstream's layer call reads it
    under `torch.compile` too), not under `torch.compile` (dynamo traces
    none of the rest), and `replicate_created_tensors` active (a step's
    context, not suspended by a local call).
    """
    import torch

    from keras.src.backend.torch import created_tensors

    current_distribution = distribution_accessor()
    in_step = created_tensors.replicating_created_tensors
    compiling = torch.compiler.is_compiling

    def in_eager_step():
        return (
            current_distribution() is not None and not compiling() and in_step()
        )

    return in_eager_step


def edit_loss_call_runs_batch_local(losses_module):
    """Built-in losses compute per-sample values on local tensors.

    Inside a distributed step, `LossFunctionWrapper.call` (the per-sample
    values of every built-in loss, before `Loss.__call__` reduces them)
    goes through `batch_local.call_layer` as a layer's call does: watched
    on DTensors the first time, then on local tensors where the watched
    call proved it local to each batch shard. The reduction over the batch
    stays on DTensors. Elsewhere the call is upstream's.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import batch_local

    wrapper_class = losses_module.LossFunctionWrapper
    upstream_call = wrapper_class.call
    in_eager_step = _in_eager_distributed_step_check()

    def call(self, y_true, y_pred):
        if not in_eager_step():
            return upstream_call(self, y_true, y_pred)
        return batch_local.call_layer(self, upstream_call, (y_true, y_pred), {})

    wrapper_class.call = call


def edit_loss_wrapper_runs_whole_on_local_tensors(losses_module):
    """A built-in loss runs whole on local tensors once proven local.

    Inside a distributed step, `LossFunctionWrapper.__call__` (upstream's
    `Loss.__call__`) goes through `batch_reductions.call_loss`: once a
    call with the same global shapes and placements has computed its
    per-sample values locally and reduced them locally, the casts, the
    values and the reduction run on the arguments' local tensors, and one
    all-reduce adds the processes' results up. A subclass with a `call` of
    its own, and every call elsewhere, keeps upstream's `__call__`.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import batch_reductions

    wrapper_class = losses_module.LossFunctionWrapper
    upstream_call = wrapper_class.__call__
    in_eager_step = _in_eager_distributed_step_check()

    def __call__(self, y_true, y_pred, sample_weight=None):
        if not in_eager_step() or type(self).call is not wrapper_class.call:
            return upstream_call(self, y_true, y_pred, sample_weight)
        return batch_reductions.call_loss(
            self, upstream_call, y_true, y_pred, sample_weight
        )

    wrapper_class.__call__ = __call__


def edit_optimizer_apply_on_local_tensors(torch_optimizer_module):
    """An optimizer step whose tensors are all replicated runs locally.

    `TorchOptimizer.apply` goes through
    `replicated_updates.apply_on_local_tensors`: where every gradient and
    every variable the step reads is a replicated DTensor, the step runs
    on their local tensors, with the values DTensor would compute;
    otherwise, and without a distribution, it is upstream's.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import replicated_updates

    optimizer_class = torch_optimizer_module.TorchOptimizer
    upstream_apply = optimizer_class.apply
    current_distribution = distribution_accessor()

    def apply(self, grads, trainable_variables=None):
        if current_distribution() is None:
            return upstream_apply(self, grads, trainable_variables)
        return replicated_updates.apply_on_local_tensors(
            self, upstream_apply, grads, trainable_variables
        )

    optimizer_class.apply = apply


def edit_metric_update_on_local_tensors(reduction_metrics):
    """A `Mean` or `Sum` updated with replicated values updates locally.

    `Mean.update_state` and `Sum.update_state` go through
    `replicated_updates.update_on_local_tensors` under a distribution:
    where the metric's variables and the values and weights are all
    replicated DTensors (the trainer's loss tracker and the step's loss,
    say), the update runs on their local tensors; otherwise, and without a
    distribution, it is upstream's.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import replicated_updates

    current_distribution = distribution_accessor()

    def local_update(metric_class):
        upstream_update = metric_class.update_state

        def update_state(self, values, sample_weight=None):
            if current_distribution() is None:
                return upstream_update(self, values, sample_weight)
            return replicated_updates.update_on_local_tensors(
                self, upstream_update, values, sample_weight
            )

        metric_class.update_state = update_state

    local_update(reduction_metrics.Mean)
    local_update(reduction_metrics.Sum)


def edit_loss_reduction_on_local_tensors(loss_module):
    """A loss's reduction over a split batch runs on local tensors.

    Inside a distributed step, `reduce_weighted_values` (what
    `Loss.__call__` reduces per-sample values with) goes through
    `batch_reductions.reduce_on_local_tensors`: values split evenly along
    the batch, with no mask, are reduced by each process on its own
    values and added up by one all-reduce. Elsewhere the reduction is
    upstream's.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import batch_reductions

    upstream_reduce = loss_module.reduce_weighted_values
    in_eager_step = _in_eager_distributed_step_check()

    def reduce_weighted_values(
        values,
        sample_weight=None,
        mask=None,
        reduction="sum_over_batch_size",
        dtype=None,
    ):
        if not in_eager_step():
            return upstream_reduce(
                values,
                sample_weight=sample_weight,
                mask=mask,
                reduction=reduction,
                dtype=dtype,
            )
        return batch_reductions.reduce_on_local_tensors(
            upstream_reduce, values, sample_weight, mask, reduction, dtype
        )

    loss_module.reduce_weighted_values = reduce_weighted_values


def edit_layer_call_distributes_inputs(layer_module):
    """A direct call of a model or layer takes the global batch.

    Under a distribution, calling `model(x)` outside `fit`, `evaluate` and
    `predict` with arrays or plain tensors distributes them on entry as a
    step does (the global batch, split along the batch axis), and runs the
    call in `replicate_created_tensors`. Calls from inside another layer,
    symbolic calls and calls without a distribution are upstream's.
    """
    if not _is_torch_backend():
        return
    current_distribution = distribution_accessor()
    from keras.src.backend.common import global_state
    from keras.src.backend.common.keras_tensor import any_symbolic_tensors

    upstream_call = layer_module.Layer.__call__

    def __call__(self, *args, **kwargs):
        distribution = current_distribution()
        if (
            distribution is None
            or global_state.get_global_attribute("current_call_ctx") is not None
        ):
            return upstream_call(self, *args, **kwargs)
        distribution_lib = _torch_distribution_lib()
        if distribution_lib.replicating_created_tensors() or (
            any_symbolic_tensors(args, kwargs)
        ):
            return upstream_call(self, *args, **kwargs)
        distribution_lib.check_model_distributed(self, distribution)
        return distribution_lib.call_on_global_batch(
            functools.partial(upstream_call, self), args, kwargs, distribution
        )

    layer_module.Layer.__call__ = __call__


def _on_global_batch(upstream_method):
    """`upstream_method`, distributing what a direct call passes it.

    Under a distribution, a call made outside a step (and outside another
    direct call, and the local calls of either) with no symbolic argument
    runs through
    `call_on_global_batch`; every other call is upstream's.
    """
    current_distribution = distribution_accessor()
    from keras.src.backend.common.keras_tensor import any_symbolic_tensors

    def method(self, *args, **kwargs):
        distribution = current_distribution()
        if distribution is None:
            return upstream_method(self, *args, **kwargs)
        distribution_lib = _torch_distribution_lib()
        if distribution_lib.in_step_context() or (
            any_symbolic_tensors(args, kwargs)
        ):
            return upstream_method(self, *args, **kwargs)
        return distribution_lib.call_on_global_batch(
            functools.partial(upstream_method, self), args, kwargs, distribution
        )

    return functools.wraps(upstream_method)(method)


def edit_loss_call_distributes_inputs(loss_module):
    """A direct call of a loss takes the global batch.

    In a custom training loop, `loss_fn(y, model(x))` meets the model's
    distributed output with the targets as the user holds them: under a
    distribution, outside a step, `Loss.__call__` distributes arrays and
    plain tensors on entry as a model's direct call does
    (`call_on_global_batch`).
    """
    if not _is_torch_backend():
        return
    loss_module.Loss.__call__ = _on_global_batch(loss_module.Loss.__call__)


def edit_metric_update_distributes_inputs(metric_module):
    """A direct update of a metric takes the global batch.

    Every metric's `update_state` is wrapped when the metric is made (as
    `Layer.__new__` wraps `build`): under a distribution, outside a step,
    it distributes arrays and plain tensors on entry as a model's direct
    call does (`call_on_global_batch`). A metric's other methods, and its
    updates inside a step, are upstream's.
    """
    if not _is_torch_backend():
        return
    metric_class = metric_module.Metric
    upstream_new = metric_class.__new__

    def __new__(cls, *args, **kwargs):
        if upstream_new is object.__new__:
            metric = upstream_new(cls)
        else:
            metric = upstream_new(cls, *args, **kwargs)
        update_state = _on_global_batch(type(metric).update_state)
        object.__setattr__(
            metric, "update_state", types.MethodType(update_state, metric)
        )
        return metric

    metric_class.__new__ = __new__


def edit_data_adapter_auto_shard(data_adapters):
    """Multi-process auto-sharding accepts every input type on torch.

    Upstream only auto-shards `tf.data` datasets. On torch, every process
    iterates the same global batches and keeps its own slice of each when
    the batch is distributed, so any adapter can be used as is: it is
    created as without auto-sharding (a later keras's adapters would
    otherwise split the data between processes themselves).
    """
    if not _is_torch_backend():
        return
    upstream_get_data_adapter = data_adapters.get_data_adapter

    def get_data_adapter(x, *args, **kwargs):
        from keras.src.distribution import distribution_lib

        distribution = distribution_lib.distribution()
        if distribution is None or data_adapters.is_tf_dataset(x):
            return upstream_get_data_adapter(x, *args, **kwargs)
        multi_process = distribution._is_multi_process
        auto_shard = distribution.auto_shard_dataset
        distribution._is_multi_process = False
        distribution.auto_shard_dataset = False
        try:
            return upstream_get_data_adapter(x, *args, **kwargs)
        finally:
            distribution._is_multi_process = multi_process
            distribution.auto_shard_dataset = auto_shard

    data_adapters.get_data_adapter = get_data_adapter


def edit_callbacks_synchronous_under_distribution(callback_list_module):
    """Under a distribution, batch callbacks run on the main thread.

    Upstream dispatches batch-end callbacks on a worker thread when no
    callback overrides them; converting the logs there gathers distributed
    values, a collective that then interleaves with the main thread's in a
    different order on each process, and the job hangs.
    """
    if not _is_torch_backend():
        return
    current_distribution = distribution_accessor()

    callback_list = callback_list_module.CallbackList
    upstream_configure = callback_list._configure_async_dispatch

    def _configure_async_dispatch(self, callbacks):
        upstream_configure(self, callbacks)
        if current_distribution() is not None:
            self._async_train = False
            self._async_test = False
            self._async_predict = False

    callback_list._configure_async_dispatch = _configure_async_dispatch


def edit_progbar_on_process_zero(progbar_module):
    """Only process 0 prints progress bars under a multi-process job.

    Every process computes the same logs, so the bars would be printed once
    per process. The other processes keep the callback (and its logic) but
    print nothing, as if `verbose=0` had been passed there.
    """
    if not _is_torch_backend():
        return
    upstream_set_params = progbar_module.ProgbarLogger.set_params

    def set_params(self, params):
        upstream_set_params(self, params)
        if _torch_distribution_lib().process_id() != 0:
            self.verbose = 0

    progbar_module.ProgbarLogger.set_params = set_params


def edit_set_distribution_shares_seed(module):
    """`set_distribution` shares the seed and converts the mesh, in lockstep.

    Every process calls `set_distribution` in the same order, so the seed
    broadcast that a process group created outside `initialize` needs
    (`distribution_lib.share_seed_once`), and the creation of the mesh's
    process groups, happen there rather than at a first use that some
    processes may reach alone (a property, a log line).
    """
    if not _is_torch_backend():
        return
    upstream_set_distribution = module.set_distribution

    def set_distribution(value):
        if value is not None:
            _torch_distribution_lib().share_seed_once()
            value.device_mesh.backend_mesh
        upstream_set_distribution(value)

    module.set_distribution = set_distribution


TRAINER_CALLS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)


def collective_failure_note(operation):
    """The note added to an error that ends `operation` on several processes.

    Returns None without a multi-process distribution.
    """
    current_distribution = distribution_accessor()

    distribution_lib = _torch_distribution_lib()
    if current_distribution() is None:
        return None
    world_size = distribution_lib.num_processes()
    if world_size == 1:
        return None
    return (
        f"Raised in `{operation}` on process "
        f"{distribution_lib.process_id()} of {world_size}. If a collective "
        "failed: under a multi-process distribution every process must "
        f"call `{operation}`, in the same order; a collective fails after "
        f"{distribution_lib.TIMEOUT_ENV_VAR} seconds when a process died "
        "or skipped the call (e.g. `if process_id == 0:`)."
    )


def edit_metrics_result_in_step_context(trainer_module):
    """Metric results are computed as a step computes its values.

    `get_metrics_result` runs after the step, on the metrics' distributed
    variables. Where all of them are replicated, it runs on their local
    tensors (`replicated_updates.result_on_local_tensors`) and returns
    plain tensors, equal on every process; otherwise it runs in
    `replicate_created_tensors`, so the index and constant tensors that
    results make from Python values (`MeanIoU`'s class indices, say) are
    replicated DTensors too.
    """
    if not _is_torch_backend():
        return
    from keras.src.backend.torch import replicated_updates

    current_distribution = distribution_accessor()

    upstream_get_metrics_result = trainer_module.Trainer.get_metrics_result

    def get_metrics_result(self):
        distribution = current_distribution()
        if distribution is None:
            return upstream_get_metrics_result(self)
        results = replicated_updates.result_on_local_tensors(
            self, upstream_get_metrics_result
        )
        if results is not None:
            return results
        with _torch_distribution_lib().replicate_created_tensors(
            distribution.device_mesh
        ):
            return upstream_get_metrics_result(self)

    trainer_module.Trainer.get_metrics_result = get_metrics_result


def edit_trainer_names_failed_calls(trainer_module):
    """Errors from collectives name the trainer call they ended.

    Under a multi-process distribution, a `RuntimeError` (what gloo and
    NCCL raise on a timeout or a lost peer) that ends `fit`, `evaluate`,
    `predict` or a `*_on_batch` call gets a note naming the call and the
    process.
    """

    def wrap(name):
        upstream = getattr(trainer_module.TorchTrainer, name)

        def method(self, *args, **kwargs):
            try:
                return upstream(self, *args, **kwargs)
            except RuntimeError as error:
                note = collective_failure_note(name)
                noted = any(
                    n.startswith("Raised in `")
                    for n in getattr(error, "__notes__", ())
                )
                if note is not None and not noted:
                    error.add_note(note)
                raise

        method.__name__ = upstream.__name__
        method.__doc__ = upstream.__doc__
        setattr(trainer_module.TorchTrainer, name, method)

    for name in TRAINER_CALLS:
        wrap(name)


# Names that a later keras renamed, per module: the name the overlay and
# the edits use (keras 3.15.1's) -> the name in that keras.
# A dotted name is an attribute of a class of the module.
RENAMED_NAMES = {
    "keras.src.backend.torch.trainer": {
        "TorchTrainer": "Trainer",
        "TorchTrainer._should_torch_compile": "_use_torch_compile",
    },
    "keras.src.trainers.trainer": {"Trainer": "BaseTrainer"},
}


def edit_renamed_names(module):
    """Gives `module` its keras 3.15.1 names that a later keras renamed."""
    for old, new in RENAMED_NAMES.get(module.__name__, {}).items():
        *owners, name = old.split(".")
        owner = module
        for part in owners:
            owner = getattr(owner, part, None)
        if owner is None or name in vars(owner):
            continue
        if hasattr(owner, new):
            setattr(owner, name, getattr(owner, new))


def _has_distributed_variables(model):
    """Whether any of `model`'s variables holds a DTensor."""
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(getattr(v, "_value", None), DTensor) for v in model.variables
    )


def edit_trainer_skips_ddp_under_distribution(trainer_module):
    """A later keras wraps the model in DDP when a process group exists:
    under a distribution the distributed step (`distributed_trainer`)
    replaces that path as a whole, so no DDP is built; nor for a model
    whose variables are DTensors (created under a distribution), which
    DDP cannot broadcast. Otherwise upstream's DDP runs as upstream wrote
    it. Keras 3.15.1 has no such path: nothing to edit there."""
    trainer_class = trainer_module.TorchTrainer
    upstream = getattr(trainer_class, "_initialize_ddp", None)
    if upstream is None:
        return
    from keras.src.distribution import distribution_lib as keras_distribution

    def _initialize_ddp(self):
        if keras_distribution.distribution() is not None:
            return
        if _has_distributed_variables(self):
            return
        return upstream(self)

    _initialize_ddp.__doc__ = upstream.__doc__
    trainer_class._initialize_ddp = _initialize_ddp


# Set to "1": without a distribution, a later keras builds no DDP either.
NO_DDP_ENV_VAR = "KERAS_DTENSOR_NO_DDP"


def edit_trainer_no_ddp_without_distribution(trainer_module):
    """Without a distribution, a later keras's trainer wraps the model in
    DDP when a process group exists (`_initialize_ddp`), and so it does
    here: upstream's behaviour. With `KERAS_DTENSOR_NO_DDP=1`, each process
    trains on its own instead, as with keras 3.15.1 (the test harness's
    single-process references do; torch 2.13.0 crashes constructing DDP
    over gloo under `TORCH_DISTRIBUTED_DEBUG=DETAIL`). Runs after
    `edit_trainer_skips_ddp_under_distribution`. Keras 3.15.1 has no such
    path: nothing to edit there."""
    trainer_class = trainer_module.TorchTrainer
    edited = getattr(trainer_class, "_initialize_ddp", None)
    if edited is None:
        return
    from keras.src.distribution import distribution_lib as keras_distribution

    def _initialize_ddp(self):
        if (
            keras_distribution.distribution() is None
            and os.environ.get(NO_DDP_ENV_VAR) == "1"
        ):
            return None
        return edited(self)

    _initialize_ddp.__doc__ = edited.__doc__
    trainer_class._initialize_ddp = _initialize_ddp


def edit_trainer_compiles_under_every_distribution(trainer_module):
    """A later keras's torch trainer refuses `jit_compile=True` under any
    distribution but `DataParallel` (`_use_torch_compile` warns and runs
    eagerly), since its own distribution enters a `TorchDispatchMode`
    that Dynamo cannot trace through. This project's `distribution_lib`
    enters none, and its compiled steps (`distributed_trainer`) serve
    every distribution, so under a distribution `jit_compile` is honoured
    as with keras 3.15.1 (unless the model runs eagerly). Without one,
    upstream's rule holds. Runs after `edit_renamed_names`, whose
    `_should_torch_compile` it updates too. Keras 3.15.1 has no such
    method: nothing to edit there."""
    trainer_class = trainer_module.TorchTrainer
    upstream = vars(trainer_class).get("_use_torch_compile")
    if upstream is None:
        return
    from keras.src.distribution import distribution_lib as keras_distribution

    def _use_torch_compile(self):
        if keras_distribution.distribution() is None:
            return upstream(self)
        return bool(self.jit_compile) and not self.run_eagerly

    _use_torch_compile.__doc__ = upstream.__doc__
    trainer_class._use_torch_compile = _use_torch_compile
    if vars(trainer_class).get("_should_torch_compile") is upstream:
        trainer_class._should_torch_compile = _use_torch_compile


def edit_trainer_metrics_not_reduced_under_distribution(trainer_module):
    """A later keras's torch trainer all-reduces the metric variables over
    the processes in `get_metrics_result` (for DDP); under a distribution
    they are DTensors holding the global values already, so the base
    trainer's `get_metrics_result` (with `edit_metrics_result_in_step_context`)
    replaces it. Keras 3.15.1's torch trainer has no such override."""
    trainer_class = trainer_module.TorchTrainer
    upstream = vars(trainer_class).get("get_metrics_result")
    if upstream is None:
        return
    from keras.src.distribution import distribution_lib as keras_distribution

    def get_metrics_result(self):
        if keras_distribution.distribution() is not None:
            return super(trainer_class, self).get_metrics_result()
        return upstream(self)

    get_metrics_result.__doc__ = upstream.__doc__
    trainer_class.get_metrics_result = get_metrics_result


def edit_trainer_batches_stay_global(trainer_module):
    """A later keras's torch trainer distributes the batches of a
    `ModelParallel` itself (`_distribute_data`, each process's batch taken
    as its shard) and hands each process the predictions of its own rows
    (`_gather_non_batch_axes`). Under a distribution here, the distributed
    step distributes the batch on entry, and `predict` returns the global
    predictions on every process, as with keras 3.15.1: the batches reach
    the step as tensors, as upstream passes them without a `ModelParallel`,
    and the step's outputs stay as they are. Keras 3.15.1 has neither
    function."""
    upstream_distribute = getattr(trainer_module, "_distribute_data", None)
    if upstream_distribute is None:
        return
    from keras.src import tree
    from keras.src.backend.torch.core import convert_to_tensor
    from keras.src.distribution import distribution_lib as keras_distribution

    def _distribute_data(data, layouts=None):
        if keras_distribution.distribution() is None:
            return upstream_distribute(data, layouts)
        return tree.map_structure(
            lambda x: None if x is None else convert_to_tensor(x), data
        )

    def _gather_non_batch_axes(data):
        return data

    trainer_module._distribute_data = _distribute_data
    trainer_module._gather_non_batch_axes = _gather_non_batch_axes


def edit_epoch_iterator_keeps_torch_dataloader(trainer_module):
    """A later keras's `TorchEpochIterator` iterates a `ModelParallel`'s
    data through the adapter's numpy iterator (`_get_distributed_iterator`),
    whose shuffling draws another order than the torch `DataLoader` of
    every other case. Under a distribution here, the batches come from
    the `DataLoader`, as with keras 3.15.1 and without a distribution, so
    a seeded `fit` sees the same batches with and without one. Keras
    3.15.1's iterator has no such path: nothing to edit there."""
    iterator_class = getattr(trainer_module, "TorchEpochIterator", None)
    if not hasattr(iterator_class, "_get_distributed_iterator"):
        return
    from keras.src.distribution import distribution_lib as keras_distribution

    upstream = iterator_class._get_iterator

    def _get_iterator(self):
        if keras_distribution.distribution() is None:
            return upstream(self)
        return self.data_adapter.get_torch_dataloader()

    iterator_class._get_iterator = _get_iterator


def _attention_placements(query, mask_shape):
    """The placements that make attention on local shards exact.

    Per mesh axis: where `query` (batch, seq, heads, head_dim) is split
    along its batch or heads dimension, query, key and value are split
    there alike, and a mask of `mask_shape` (broadcast from the right to
    (batch, heads, seq, seq)) along the same dimension where it is not of
    size 1; anything else (a sequence split, a partial sum) is
    replicated.

    Returns:
        A tuple of the query, key and value placements and the mask's.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

    qkv, masks = [], []
    for placement in query.placements:
        if type(placement) is not Shard or placement.dim not in (0, 2):
            qkv.append(Replicate())
            masks.append(Replicate())
            continue
        qkv.append(Shard(placement.dim))
        mask_dim = None
        if mask_shape is not None:
            mask_dim = (0 if placement.dim == 0 else 1) - 4 + len(mask_shape)
        if mask_dim is None or mask_dim < 0 or mask_shape[mask_dim] == 1:
            masks.append(Replicate())
        else:
            masks.append(Shard(mask_dim))
    return tuple(qkv), tuple(masks)


def _lay_out_attention_inputs(query, key, value, masks):
    """Query, key, value and masks (mask or bias, or None) laid out by
    `_attention_placements`, key and value repeated to the query's heads
    (grouped-query attention) where the heads are split."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate

    mesh = query.device_mesh
    shapes = [None if m is None else tuple(m.shape) for m in masks]
    mask_shape = next((shape for shape in shapes if shape is not None), None)
    qkv, mask_placements = _attention_placements(query, mask_shape)
    heads_split = any(getattr(p, "dim", None) == 2 for p in qkv)
    if heads_split and key.shape[2] != query.shape[2]:
        groups = query.shape[2] // key.shape[2]
        key = torch.repeat_interleave(key, groups, dim=2)
        value = torch.repeat_interleave(value, groups, dim=2)
    query, key, value = (t.redistribute(mesh, qkv) for t in (query, key, value))
    laid_out = []
    for mask in masks:
        if mask is not None and not isinstance(mask, DTensor):
            mask = DTensor.from_local(
                torch.as_tensor(mask), mesh, [Replicate()] * mesh.ndim
            )
        if mask is not None:
            mask = mask.redistribute(mesh, mask_placements)
        laid_out.append(mask)
    return query, key, value, laid_out


def edit_attention_inputs_fit_local_shards(nn):
    """A later keras's torch `dot_product_attention` computes DTensor
    inputs on their local shards and wraps the result in the query's
    placements, which is exact only where query, key, value and mask are
    split alike along batch or heads. This project's layouts need not be
    (a query partial over an axis that split its contracting dimension,
    keys split on another): there the inputs are first laid out so that
    it is (`_attention_placements`). Keras 3.15.1's torch `nn` (another
    module) computes on the DTensors and is not edited."""
    from torch.distributed.tensor import DTensor

    upstream = nn.dot_product_attention

    def dot_product_attention(
        query, key, value, bias=None, mask=None, *args, **kwargs
    ):
        if all(isinstance(t, DTensor) for t in (query, key, value)):
            query, key, value, (bias, mask) = _lay_out_attention_inputs(
                query, key, value, (bias, mask)
            )
        return upstream(query, key, value, bias, mask, *args, **kwargs)

    dot_product_attention.__doc__ = upstream.__doc__
    nn.dot_product_attention = dot_product_attention


# Upstream module name -> edits to apply once it has executed. Values are
# functions so that nothing is looked up before the module is imported.
POST_IMPORT_EDITS = {
    "keras.src.backend.torch.core": lambda: [
        check_supported_versions,
        edit_variable_skips_upstream_distribution,
        edit_variable_initialize,
        edit_variable_initialize_shard_by_shard,
        edit_variable_created_as_outside_builds,
        edit_variable_assign,
        edit_variable_repr,
        edit_convert_to_numpy,
        edit_compute_output_spec,
    ],
    "keras.src.backend": lambda: [edit_backend_distribution_lib],
    "keras.src.distribution.distribution_lib": lambda: [
        edit_distribution_api_binding,
        edit_tensor_layout_multi_axis,
        edit_set_distribution_shares_seed,
    ],
    "keras.src.backend.torch.trainer": lambda: [
        edit_renamed_names,
        edit_trainer_skips_ddp_under_distribution,
        edit_trainer_no_ddp_without_distribution,
        edit_trainer_compiles_under_every_distribution,
        edit_trainer_metrics_not_reduced_under_distribution,
        edit_trainer_batches_stay_global,
        edit_epoch_iterator_keeps_torch_dataloader,
        edit_trainer_step_functions,
        edit_trainer_names_failed_calls,
    ],
    "keras.src.trainers.trainer": lambda: [
        edit_renamed_names,
        edit_metrics_result_in_step_context,
    ],
    "keras.src.trainers.data_adapters": lambda: [edit_data_adapter_auto_shard],
    "keras.src.layers.layer": lambda: [
        edit_layer_call_runs_batch_local,
        edit_layer_call_distributes_inputs,
        edit_layer_build_replicates_created_tensors,
    ],
    # Before `losses`: its `LossFunctionWrapper` edit calls the edited
    # `Loss.__call__` when the mount is armed after keras is imported.
    "keras.src.losses.loss": lambda: [
        edit_loss_reduction_on_local_tensors,
        edit_loss_call_distributes_inputs,
    ],
    "keras.src.losses.losses": lambda: [
        edit_loss_call_runs_batch_local,
        edit_loss_wrapper_runs_whole_on_local_tensors,
    ],
    "keras.src.metrics.metric": lambda: [edit_metric_update_distributes_inputs],
    "keras.src.metrics.reduction_metrics": lambda: [
        edit_metric_update_on_local_tensors
    ],
    "keras.src.backend.torch.optimizers.torch_optimizer": lambda: [
        edit_optimizer_apply_on_local_tensors
    ],
    # A later keras's torch `nn` module (3.15.1 has no such module).
    "keras.src.backend.torch.ops.nn": lambda: [
        edit_attention_inputs_fit_local_shards
    ],
    "keras.src.callbacks.progbar_logger": lambda: [
        edit_progbar_on_process_zero
    ],
    "keras.src.callbacks.callback_list": lambda: [
        edit_callbacks_synchronous_under_distribution
    ],
}


def _merge_edit_tables(*tables):
    """Combines edit tables; edits for one module run in table order."""
    merged = {}
    for table in tables:
        for name, edits_for in table.items():
            previous = merged.get(name)
            if previous is None:
                merged[name] = edits_for
            else:
                merged[name] = lambda first=previous, second=edits_for: (
                    first() + second()
                )
    return merged


POST_IMPORT_EDITS = _merge_edit_tables(
    POST_IMPORT_EDITS,
    _saving_edits.POST_IMPORT_EDITS,
    _keras_hub_edits.POST_IMPORT_EDITS,
)


def apply_to_loaded_modules():
    """Applies the edits to modules imported before the mount was armed."""
    for name, edits_for in POST_IMPORT_EDITS.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        for edit in edits_for():
            edit(module)
