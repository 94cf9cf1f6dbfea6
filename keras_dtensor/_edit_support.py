"""What the post-import edits share: the backend test and the readers of
the active distribution and of the torch `distribution_lib`.

Each reader imports keras inside it: the edit modules are loaded when the
mount is armed, and import neither torch nor keras at module level.
"""

import functools


def is_torch_backend():
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


def torch_distribution_lib():
    from keras.src.backend.torch import distribution_lib

    return distribution_lib


def local_call_step_state():
    """This thread's `local_call_state.StepState` (its `local_calls`:
    whether a local call is running)."""
    from keras.src.backend.torch import local_call_state

    return local_call_state.step_state()


def in_eager_distributed_step_check(or_replaying=False):
    """A function telling whether a call runs in an eager distributed step.

    That is: a distribution set (checked first, in one Python call: without
    a distribution nothing else is asked; upstream's layer call reads it
    under `torch.compile` too), not under `torch.compile` (dynamo traces
    none of the rest), and `replicate_created_tensors` active (a step's
    context, not suspended by a local call). With `or_replaying`, also
    inside a local call that replays its first call's layer ends
    (`local_replays`).
    """
    import torch

    from keras.src.backend.torch import created_tensors
    from keras.src.backend.torch import local_call_state

    current_distribution = distribution_accessor()
    in_step = created_tensors.replicating_created_tensors
    compiling = torch.compiler.is_compiling
    state = local_call_state.step_state()

    def in_eager_step():
        return (
            current_distribution() is not None and not compiling() and in_step()
        )

    def in_eager_step_or_replay():
        return (
            current_distribution() is not None
            and not compiling()
            and (in_step() or bool(state.replays))
        )

    return in_eager_step_or_replay if or_replaying else in_eager_step
