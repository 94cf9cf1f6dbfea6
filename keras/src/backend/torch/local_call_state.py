"""The state that local layer calls (`batch_local`) keep, in two objects.

- `step_state()`: this thread's `StepState`, the state of the step that
  runs on it: how many local calls are running (nested ones count each),
  how many steps whose backward pass accumulates into the variables are
  running, the sharded values of the variables that a first call reads
  unsharded, and how many effects (`local_call_checks.note_effect`) were
  counted. Per thread, as torch's function modes are: a backward pass
  that autograd runs on a device thread recomputes a checkpointed local
  call with that thread's counts.
- `caches()`: the process's `LocalCallCaches`: per layer its local-call
  plans by signature, per DTensor output of a local call the local
  tensor it computed, and per variable value the specs of its local
  views' gradients. Per process, not in Keras's global state (per thread
  and dropped by `clear_session`): a layer's plans hold for its life.
  Weakly keyed: an entry goes with its layer or tensor; nothing is
  stored on the tensors themselves.

Contract: reading or changing this state issues no collective and runs
no torch operator.
"""

import collections
import contextlib
import threading
import weakref


class StepState(threading.local):
    """The state of the steps running on this thread.

    Attributes:
        local_calls: the number of local calls running (nested calls
            count each).
        accumulating_steps: the number of steps running whose backward
            pass accumulates into the variables
            (`accumulating_into_variables`).
        unsharded: id(variable) -> its sharded value, while a first call
            reads the variable unsharded (`local_call_checks`).
        effects: the number of effects counted so far
            (`local_call_checks.note_effect`).
        owned_writes: the number of writes of held values into owned
            elements counted so far (`local_call_checks.note_owned_write`).
        verdicts: the number of verdicts agreed on so far, one
            all-reduce each (`inference_local_calls`).
        recordings: the `local_replays.Record`s of the first calls
            running on DTensors, innermost last.
        replays: the `local_replays.Replay`s of the local runs running,
            innermost last.
        layer_end_collectives: process group -> the all-reduces issued
            on it at layer ends (`local_replays.layer_end`).
        dtensor_checks: the number of check runs on DTensors running
            (`training_local_calls`): inside one, every layer runs on
            DTensors, reading the variables the check gives it.
    """

    def __init__(self):
        self.local_calls = 0
        self.accumulating_steps = 0
        self.unsharded = {}
        self.effects = 0
        self.owned_writes = 0
        self.verdicts = 0
        self.recordings = []
        self.replays = []
        self.layer_end_collectives = collections.Counter()
        self.dtensor_checks = 0


# One object; `threading.local` gives each thread its own attributes.
_STEP_STATE = StepState()


def step_state():
    """This thread's `StepState`."""
    return _STEP_STATE


def running_locally():
    """Whether a local call is running: its tensors are local shards."""
    return _STEP_STATE.local_calls > 0


def accumulating():
    """Whether a step that accumulates into the variables is running."""
    return _STEP_STATE.accumulating_steps > 0


@contextlib.contextmanager
def accumulating_into_variables():
    """Marks a step whose backward pass accumulates into the variables.

    Inside it, local calls read replicated variables as gradient leaves
    (`local_gradients.gradient_leaf`), whose gradients autograd hands
    to the buckets as soon as each is complete. For a step that calls
    `loss.backward()` and reads the variables' gradients, as Keras's
    train step does: `torch.autograd.grad` of a variable does not see its
    gradient leaves.
    """
    _STEP_STATE.accumulating_steps += 1
    try:
        yield
    finally:
        _STEP_STATE.accumulating_steps -= 1


class WeakIdMap:
    """A map keyed by object identity whose entries go with their keys.

    As `torch.utils.weak.WeakIdKeyDictionary`, at the cost of one dict
    lookup: that one builds a `WeakIdRef` and runs Python `__hash__` and
    `__eq__` on every access, about 1.6 us per local call's argument and
    output where a tensor attribute cost 0.05 us (this one: 0.2 us).
    """

    def __init__(self):
        # id(key) -> (weak reference to the key, value).
        self._entries = {}

    def get(self, key, default=None):
        entry = self._entries.get(id(key))
        # A dead key's entry goes with it (`__setitem__`'s callback),
        # before its id can name another object; checked all the same.
        if entry is None or entry[0]() is not key:
            return default
        return entry[1]

    def __getitem__(self, key):
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            raise KeyError(key)
        return entry[1]

    def __contains__(self, key):
        entry = self._entries.get(id(key))
        return entry is not None and entry[0]() is key

    def __len__(self):
        return len(self._entries)

    def __setitem__(self, key, value):
        key_id = id(key)
        entries = self._entries

        def remove(ref):
            # Only the entry of this reference: not one set since.
            entry = entries.get(key_id)
            if entry is not None and entry[0] is ref:
                entries.pop(key_id, None)

        entries[key_id] = (weakref.ref(key, remove), value)


class LocalCallCaches:
    """What local calls keep from call to call.

    Attributes:
        plans: layer -> {call signature: `local_call_checks.LocalCallPlan`,
            or None where the layer must run on DTensors}.
        computed: DTensor output of a local call -> (the local tensor the
            call computed, the DTensor's version counter when it was
            made) (`local_calls.local_tensor_of`).
        gradient_specs: replicated or sharded DTensor variable value read
            through a local view -> {gradient placements: DTensorSpec of
            the view's gradient} (`local_variables`).
    """

    def __init__(self):
        self.plans = weakref.WeakKeyDictionary()
        self.computed = WeakIdMap()
        self.gradient_specs = WeakIdMap()


# One object for the process, as layers are shared between threads.
_CACHES = LocalCallCaches()


def caches():
    """The process's `LocalCallCaches`."""
    return _CACHES
