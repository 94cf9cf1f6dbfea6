"""The edits for keras-nightly (3.16.0.dev2026102704), whose torch backend
has a distribution of its own.

keras-nightly's torch backend distributes variables, wraps models in DDP,
refuses `jit_compile` under `ModelParallel`, splits batches and gathers
predictions itself. Under a distribution here, each edit switches one of
those paths off so that this project's serves it, as with keras 3.15.1;
without a distribution, upstream's path runs. Every edit finds nothing to
edit on keras 3.15.1. This module can be deleted as a unit with the
nightly support (`_versions.TESTED_KERAS_NIGHTLY`).
"""

import os


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


def edit_attention_inputs_fit_local_shards(nn):
    """A later keras's torch `dot_product_attention` computes DTensor
    inputs on their local shards and wraps the result in the query's
    placements, which is exact only where query, key, value and mask are
    split alike along batch or heads. This project's layouts need not be
    (a query partial over an axis that split its contracting dimension,
    keys split on another): there the inputs are first laid out so that
    it is (`attention_layouts`). Keras 3.15.1's torch `nn` (another
    module) computes on the DTensors and is not edited."""
    from torch.distributed.tensor import DTensor

    from keras.src.backend.torch.attention_layouts import (
        lay_out_attention_inputs,
    )

    upstream = nn.dot_product_attention

    def dot_product_attention(
        query, key, value, bias=None, mask=None, *args, **kwargs
    ):
        if all(isinstance(t, DTensor) for t in (query, key, value)):
            query, key, value, (bias, mask) = lay_out_attention_inputs(
                query, key, value, (bias, mask)
            )
        return upstream(query, key, value, bias, mask, *args, **kwargs)

    dot_product_attention.__doc__ = upstream.__doc__
    nn.dot_product_attention = dot_product_attention


# Upstream module name -> the nightly edits to apply once it has executed;
# for one module, they run before `_edits`' (`edit_renamed_names` gives
# the 3.15.1 names those use).
POST_IMPORT_EDITS = {
    "keras.src.backend.torch.core": lambda: [
        edit_variable_skips_upstream_distribution
    ],
    "keras.src.backend.torch.trainer": lambda: [
        edit_renamed_names,
        edit_trainer_skips_ddp_under_distribution,
        edit_trainer_no_ddp_without_distribution,
        edit_trainer_compiles_under_every_distribution,
        edit_trainer_metrics_not_reduced_under_distribution,
        edit_trainer_batches_stay_global,
        edit_epoch_iterator_keeps_torch_dataloader,
    ],
    "keras.src.trainers.trainer": lambda: [edit_renamed_names],
    # A later keras's torch `nn` module (3.15.1 has no such module).
    "keras.src.backend.torch.ops.nn": lambda: [
        edit_attention_inputs_fit_local_shards
    ],
}
