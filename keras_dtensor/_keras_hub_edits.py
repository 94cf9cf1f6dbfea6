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


POST_IMPORT_EDITS = {
    "keras_hub.src.models.causal_lm": lambda: [
        edit_causal_lm_generates_on_global_batch
    ],
}
