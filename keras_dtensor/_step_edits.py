"""The post-import edits of the trainer's steps and of what runs around
them: data adapters, callbacks, the progress bar.

Under a distribution, the step functions are the distributed ones
(`distributed_trainer`), metrics results are read inside a step's
context, an error that ends `fit`, `evaluate` or `predict` names the
call and the process, numpy input is split by the distribution, batch-end
callbacks run on the main thread, and only process 0 prints progress.
UPSTREAMING.md lists each edit with the in-tree change it stands for.
"""

from keras_dtensor import _edit_support as support


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
    if not support.is_torch_backend():
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


def edit_data_adapter_auto_shard(data_adapters):
    """Multi-process auto-sharding accepts every input type on torch.

    Upstream only auto-shards `tf.data` datasets. On torch, every process
    iterates the same global batches and keeps its own slice of each when
    the batch is distributed, so any adapter can be used as is: it is
    created as without auto-sharding (a later keras's adapters would
    otherwise split the data between processes themselves).
    """
    if not support.is_torch_backend():
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
    if not support.is_torch_backend():
        return
    current_distribution = support.distribution_accessor()

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
    if not support.is_torch_backend():
        return
    upstream_set_params = progbar_module.ProgbarLogger.set_params

    def set_params(self, params):
        upstream_set_params(self, params)
        if support.torch_distribution_lib().process_id() != 0:
            self.verbose = 0

    progbar_module.ProgbarLogger.set_params = set_params


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
    current_distribution = support.distribution_accessor()

    distribution_lib = support.torch_distribution_lib()
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
    if not support.is_torch_backend():
        return
    from keras.src.backend.torch import replicated_updates

    current_distribution = support.distribution_accessor()

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
        with support.torch_distribution_lib().replicate_created_tensors(
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


# Upstream module name -> edits to apply once it has executed.
POST_IMPORT_EDITS = {
    "keras.src.backend.torch.trainer": lambda: [
        edit_trainer_step_functions,
        edit_trainer_names_failed_calls,
    ],
    "keras.src.trainers.trainer": lambda: [
        edit_metrics_result_in_step_context,
    ],
    "keras.src.trainers.data_adapters": lambda: [edit_data_adapter_auto_shard],
    "keras.src.callbacks.progbar_logger": lambda: [
        edit_progbar_on_process_zero
    ],
    "keras.src.callbacks.callback_list": lambda: [
        edit_callbacks_synchronous_under_distribution
    ],
}
