"""Post-import edits of keras-hub, a client of the distribution API.

keras-hub is not part of Keras, so these edits stand for changes to
keras-hub (listed in UPSTREAMING.md, "keras-hub"), not to Keras: where
keras-hub gives a backend its own branch, the torch backend under a
distribution gets one. As in `keras_dtensor._edits`, each edit is one
small function applied to the module after it executes, only under the
torch backend; this module imports neither torch, keras nor keras-hub at
module level. Without a distribution every edited function is
keras-hub's.
"""

# `_edits` imports this module first; its functions are used only when
# the edits run, after both modules have executed.
from keras_dtensor import _edit_support as support


def edit_causal_lm_generates_on_global_batch(causal_lm_module):
    """Under a distribution, `CausalLM.generate` runs like a step.

    keras-hub's torch branch of `make_generate_function` runs
    `generate_step` eagerly: the cache is made from Python values
    (`ops.zeros`), the sampler's loop mixes the model's outputs with
    tensors it makes, and the layers are called directly. Under a
    distribution the whole function runs through
    `distribution_lib.call_on_global_batch`: the prompts are the global
    batch (`generate` has laid them out along the batch axis already), and
    every tensor made inside is a replicated DTensor, as in a step
    (`replicate_created_tensors`). A prompt batch that does not divide
    by the processes splitting the batch is padded with copies of its
    last prompt, whose outputs are dropped (`pad_to_divide`).

    Stands for: in `keras_hub/src/models/causal_lm.py`,
    `make_generate_function`'s torch branch runs `generate_step` through
    `call_on_global_batch` when a distribution is set.
    """
    if not support.is_torch_backend():
        return
    causal_lm = causal_lm_module.CausalLM
    upstream = causal_lm.make_generate_function
    current_distribution = support.distribution_accessor()

    def make_generate_function(self):
        if self.generate_function is not None:
            return self.generate_function
        generate_function = upstream(self)

        def generate_on_global_batch(inputs, stop_token_ids=None):
            distribution = current_distribution()
            if distribution is None:
                return generate_function(inputs, stop_token_ids)
            from keras.src.backend.torch import batch_distribution

            inputs, rows = batch_distribution.pad_to_divide(
                inputs, distribution
            )
            outputs = support.torch_distribution_lib().call_on_global_batch(
                generate_function,
                (inputs,),
                {"stop_token_ids": stop_token_ids},
                distribution,
            )
            if rows is None:
                return outputs
            return {key: value[:rows] for key, value in outputs.items()}

        self.generate_function = generate_on_global_batch
        return generate_on_global_batch

    make_generate_function.__doc__ = upstream.__doc__
    causal_lm.make_generate_function = make_generate_function


def edit_preset_loader_creates_loaded_variables_empty(preset_utils):
    """Under a distribution, `from_preset` that loads weights creates the
    model's sharded variables empty, and initializes only those the
    preset's weights do not write.

    keras-hub creates the backbone (or task) from its config, which runs
    every initializer, then loads the weights over them. Inside
    `deferred_initialization.loading_created_variables`, a sharded
    variable made shard by shard starts empty, and gets its initial
    values when the load ends only if no weight was written into it (a
    task's head that the preset does not hold, say), exactly those it
    would have had.

    Stands for: in `keras_hub/src/utils/preset_utils.py`,
    `KerasPresetLoader.load_backbone` and `load_task` run inside that
    scope when `load_weights` is true and a distribution is set.
    """
    if not support.is_torch_backend():
        return
    loader = getattr(preset_utils, "KerasPresetLoader", None)
    current_distribution = support.distribution_accessor()
    for name in ("load_backbone", "load_task"):
        # A keras-hub without them loads as it does: only memory differs.
        if not hasattr(loader, name):
            continue
        setattr(
            loader,
            name,
            _creating_loaded_variables_empty(
                getattr(loader, name), current_distribution
            ),
        )


def _creating_loaded_variables_empty(upstream, current_distribution):
    """`upstream(self, cls, load_weights, ...)` inside the deferring scope
    where it loads weights under a distribution."""

    def load(self, cls, load_weights, *args, **kwargs):
        if not load_weights or current_distribution() is None:
            return upstream(self, cls, load_weights, *args, **kwargs)
        from keras.src.backend.torch import deferred_initialization

        with deferred_initialization.loading_created_variables():
            return upstream(self, cls, load_weights, *args, **kwargs)

    load.__doc__ = upstream.__doc__
    load.__name__ = upstream.__name__
    return load


POST_IMPORT_EDITS = {
    "keras_hub.src.models.causal_lm": lambda: [
        edit_causal_lm_generates_on_global_batch
    ],
    "keras_hub.src.utils.preset_utils": lambda: [
        edit_preset_loader_creates_loaded_variables_empty
    ],
}
