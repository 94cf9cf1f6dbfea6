"""Activation recomputation (rematerialization) chosen by layer path.

`remat_layers` turns on Keras's own rematerialization (the mode that
`keras.RematScope(mode="full")` gives the layers created inside it) for
the layers of a built model whose path matches a regex. On the torch
backend a recomputed layer's call runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: its
intermediate activations are dropped after the forward pass and computed
again during backward.

Nothing here depends on a backend.
"""

import re

from keras.src.api_export import keras_export
from keras.src.backend.common.remat import RematScope
from keras.src.backend.common.remat import get_current_remat_mode
from keras.src.distribution import layout_composition


@keras_export("keras.distribution.remat_layers")
def remat_layers(model, patterns):
    """Recomputes the activations of the layers whose path matches.

    Each layer of `model` (the model included) whose path, as the layout
    helpers compute it (e.g. `block_0` or `decoder_layer_1/mlp`),
    `re.fullmatch`es one of `patterns` gets Keras's full
    rematerialization mode, the one `keras.RematScope(mode="full")` gives
    layers created inside it. From its next call on, the layer keeps only
    its inputs for backward and runs its `call` again during backward
    (`torch.utils.checkpoint` on torch). The result is the same; peak
    activation memory goes down and each step does one more forward pass
    of the matched layers. Under a distribution, the forward collectives
    of a recomputed layer run again in backward, in the same order on
    every process.

    Call it on a built model: a functional or sequential model, or a
    subclassed one after its first call (layer paths exist only once
    layers have been called). An abstract model built under
    `keras.StatelessScope()` works too, so it composes with the layout
    helpers before any variable exists. The mode is an attribute of the
    layer objects: it is not saved with the model, so call this again
    after loading.

    Example:

    ```python
    model = make_transformer()  # blocks named block_0, block_1, ...
    kd.remat_layers(model, r"block_\\d+")
    model.fit(x, y)  # each block recomputes its activations in backward
    ```

    Args:
        model: a built Keras model or layer.
        patterns: a regex or a list of regexes, matched with
            `re.fullmatch` against every layer path.

    Returns:
        A list of the paths of the layers that now recompute their
        activations.

    Raises:
        ValueError: if a pattern is not a valid regex, a pattern matches
            no layer (the message lists the layer paths), or a matched
            layer (or a layer inside it) draws random numbers from an
            explicitly seeded Keras `SeedGenerator`: recomputing it would
            advance the seed again and draw different numbers in backward
            (unseeded layers such as `Dropout(rate)` use the backend's
            global generator, whose state the recomputation restores).
    """
    matched = _matched_layers(model, _compile(patterns))
    for layer, path in matched:
        _check_no_seeded_random(layer, path)
    mode = full_remat_mode()
    for layer, _ in matched:
        layer._remat_mode = mode
    return [path for _, path in matched]


def _matched_layers(model, compiled):
    """`(layer, path)` of each layer whose path a pattern fullmatches.

    Raises:
        ValueError: if a pattern matches no layer, listing the layer paths.
    """
    layers = layout_composition.called_layers(model)
    paths = [layout_composition.layer_path(layer) for layer in layers]
    unmatched = [
        pattern.pattern
        for pattern in compiled
        if not any(pattern.fullmatch(path) for path in paths)
    ]
    if unmatched:
        raise ValueError(
            f"Remat patterns {unmatched} match no layer path of "
            f"{getattr(model, 'name', model)!r}. Each pattern must "
            "`re.fullmatch` at least one layer path (layers have a path "
            f"once they have been called). Layer paths: {paths}"
        )
    return [
        (layer, path)
        for layer, path in zip(layers, paths)
        if any(pattern.fullmatch(path) for pattern in compiled)
    ]


def full_remat_mode():
    """Returns the mode `keras.RematScope(mode="full")` gives its layers."""
    with RematScope(mode="full"):
        return get_current_remat_mode()


def _compile(patterns):
    """Returns `patterns` (a regex or a list of them) compiled."""
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    try:
        compiled = [re.compile(pattern) for pattern in patterns]
    except (re.error, TypeError) as error:
        raise ValueError(
            "`patterns` must be a regex or a list of regexes. "
            f"Received: patterns={patterns!r} ({error})"
        ) from None
    if not compiled:
        raise ValueError(
            "`patterns` must name at least one regex. "
            f"Received: patterns={patterns!r}"
        )
    return compiled


def _check_no_seeded_random(layer, path):
    """Raises if `layer` or a layer inside it uses a seeded generator."""
    for inner in layer._flatten_layers(include_self=True, recursive=True):
        for generator in getattr(inner, "_seed_generators", ()):
            if generator._initial_seed is not None:
                raise ValueError(
                    f"Cannot recompute layer '{path}': its layer "
                    f"'{inner.name}' draws random numbers from a seeded "
                    f"SeedGenerator (seed={generator._initial_seed}), "
                    "whose state the recomputation would advance again, "
                    "drawing different numbers in backward. Create that "
                    "layer without a seed, or leave it out of the patterns."
                )
