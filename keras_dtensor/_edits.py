"""The post-import edits: what would be changes to upstream keras files.

Each edit is one small function that takes the freshly executed upstream
module and changes it in place. UPSTREAMING.md lists every edit with the
in-tree change it stands for. Edits act only under the torch backend, so
keras on any other backend is exactly upstream keras.

The edits of layers, losses, metrics and the optimizer are here: under a
distribution their inputs are laid out on the global batch, and in an
eager step a layer or loss may run on local tensors (`batch_local`).
Those of variables and the distribution API are `_variable_edits`'; of
the trainer's steps and callbacks, `_step_edits'`; of saving,
`_saving_edits'`; of keras-hub, `_keras_hub_edits'`; for keras-nightly,
`_nightly_edits'`; the version gate is `_versions`. `POST_IMPORT_EDITS`
merges their tables.

This module is loaded when the mount is armed, at the first `keras` import:
it imports neither torch nor keras at module level.
"""

import functools
import sys
import types

from keras_dtensor import _edit_support as support
from keras_dtensor import _keras_hub_edits
from keras_dtensor import _nightly_edits
from keras_dtensor import _saving_edits
from keras_dtensor import _step_edits
from keras_dtensor import _variable_edits
from keras_dtensor import _versions


def edit_layer_call_runs_batch_local(layer_module):
    """Inside a distributed step, layer calls go through `batch_local`.

    A layer whose first call with a given signature computed each batch
    shard alone (no collective, replicated variables, no random draw or
    state change) runs on local tensors from then on; see
    `keras.src.backend.torch.batch_local`. Inside such a local call, a
    layer's input spec is not checked against the local shards: its first
    call checked the global shapes. Outside a distributed step, and
    without a distribution, the call is upstream's.
    """
    if not support.is_torch_backend():
        return
    from keras.src.backend.torch import batch_local

    upstream_call = layer_module.Layer.__call__
    # A local call that replays its first call's layer ends
    # (`local_replays`) sees its sublayers' calls end too.
    in_eager_step = support.in_eager_distributed_step_check(or_replaying=True)

    def __call__(self, *args, **kwargs):
        if not in_eager_step():
            return upstream_call(self, *args, **kwargs)
        return batch_local.call_layer(self, upstream_call, args, kwargs)

    layer_module.Layer.__call__ = __call__
    upstream_assert = layer_module.Layer._assert_input_compatibility
    state = support.local_call_step_state()

    def _assert_input_compatibility(self, arg_0):
        # A local call's inputs are local shards (split along an axis
        # its input spec may fix, a row-parallel `Dense`'s last); its
        # first call, on DTensors, checked their global shapes.
        if state.local_calls:
            return None
        return upstream_assert(self, arg_0)

    layer_module.Layer._assert_input_compatibility = _assert_input_compatibility


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
    if not support.is_torch_backend():
        return
    current_distribution = support.distribution_accessor()
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
        with support.torch_distribution_lib().replicate_built_tensors(
            distribution.device_mesh
        ):
            return upstream_build(*args, **kwargs)

    return build


def edit_loss_call_runs_batch_local(losses_module):
    """Built-in losses compute per-sample values on local tensors.

    Inside a distributed step, `LossFunctionWrapper.call` (the per-sample
    values of every built-in loss, before `Loss.__call__` reduces them)
    goes through `batch_local.call_layer` as a layer's call does: watched
    on DTensors the first time, then on local tensors where the watched
    call proved it local to each batch shard. The reduction over the batch
    stays on DTensors. Elsewhere the call is upstream's.
    """
    if not support.is_torch_backend():
        return
    from keras.src.backend.torch import batch_local

    wrapper_class = losses_module.LossFunctionWrapper
    upstream_call = wrapper_class.call
    in_eager_step = support.in_eager_distributed_step_check(or_replaying=True)

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
    if not support.is_torch_backend():
        return
    from keras.src.backend.torch import batch_reductions

    wrapper_class = losses_module.LossFunctionWrapper
    upstream_call = wrapper_class.__call__
    in_eager_step = support.in_eager_distributed_step_check()

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
    if not support.is_torch_backend():
        return
    from keras.src.backend.torch import replicated_updates

    optimizer_class = torch_optimizer_module.TorchOptimizer
    upstream_apply = optimizer_class.apply
    current_distribution = support.distribution_accessor()

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
    if not support.is_torch_backend():
        return
    from keras.src.backend.torch import replicated_updates

    current_distribution = support.distribution_accessor()

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
    if not support.is_torch_backend():
        return
    from keras.src.backend.torch import batch_reductions

    upstream_reduce = loss_module.reduce_weighted_values
    in_eager_step = support.in_eager_distributed_step_check()

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
    if not support.is_torch_backend():
        return
    current_distribution = support.distribution_accessor()
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
        distribution_lib = support.torch_distribution_lib()
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
    current_distribution = support.distribution_accessor()
    from keras.src.backend.common.keras_tensor import any_symbolic_tensors

    def method(self, *args, **kwargs):
        distribution = current_distribution()
        if distribution is None:
            return upstream_method(self, *args, **kwargs)
        distribution_lib = support.torch_distribution_lib()
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
    if not support.is_torch_backend():
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
    if not support.is_torch_backend():
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


# Upstream module name -> edits to apply once it has executed. Values are
# functions so that nothing is looked up before the module is imported.
POST_IMPORT_EDITS = {
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


# The version gate first, then keras-nightly's edits (which give the 3.15.1
# names the others use), for each module.
POST_IMPORT_EDITS = _merge_edit_tables(
    _versions.POST_IMPORT_EDITS,
    _nightly_edits.POST_IMPORT_EDITS,
    _variable_edits.POST_IMPORT_EDITS,
    _step_edits.POST_IMPORT_EDITS,
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
