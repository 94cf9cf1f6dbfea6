"""The variables of a local call, read as local views through a scope.

A local call (`batch_local`) runs its layer inside a
`LocalVariableScope`, a Keras `StatelessScope` whose
`get_current_value` gives each variable's local view:

- a replicated DTensor variable: its local tensor (`LocalView`, as
  `DTensor.to_local`), whose gradient goes back to the variable as a
  DTensor partial over the mesh axes that split the batch, as DTensor's
  own gradient of a replicated variable used with split inputs is; in a
  step that accumulates into the variables, a gradient leaf whose
  gradient goes straight to the variable's bucket
  (`local_gradients.gradient_leaf`);
- a variable sharded over the batch axes: its unsharded value's local
  tensor (`unit_gathering`), not cached.

The view of each replicated variable read with gradients on is cached on
the call's plan and read again by the next calls while the variable holds
the same value. The scope refuses assignments, which the first call did
not make.

Contract: reading a replicated variable issues no collective; a sharded
one is unsharded by `unit_gathering.UnitGathering`.
"""

from typing import NamedTuple

import torch

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch import local_call_state
from keras.src.backend.torch import local_gradients
from keras.src.backend.torch import local_views
from keras.src.backend.torch import torch_internals
from keras.src.backend.torch import unit_gathering


def describe(owner):
    """How errors name a layer (its path) or a loss (its class and name)."""
    path = getattr(owner, "path", None)
    if path is not None:
        return f"Layer '{path}'"
    return f"{type(owner).__name__} '{owner.name}'"


class CachedView(NamedTuple):
    """A replicated variable's local view, cached from call to call.

    Attributes:
        value: the variable's DTensor value when the view was made.
        local: that value's local tensor.
        view: the view.
        accumulating: whether it was made in a step accumulating into the
            variables (it may then be a gradient leaf).
    """

    value: object
    local: torch.Tensor
    view: torch.Tensor
    accumulating: bool


class LocalVariableScope(StatelessScope):
    """A `StatelessScope` that reads each variable as its local view.

    Attributes:
        layer: the layer (or loss) that runs locally.
        gradient_placements: the placements of the views' gradients:
            `Partial` on the mesh axes that split the batch.
        gathering: the call's `unit_gathering.UnitGathering`, or None for
            a layer that reads no sharded variable.
        views: id(variable) -> its `CachedView`, kept from call to call
            (the plan's), or None (inside a checkpoint, whose two passes
            read views made in each).
    """

    def __init__(
        self,
        layer,
        gradient_placements,
        units=None,
        resharding=None,
        views=None,
    ):
        super().__init__(initialize_variables=False)
        self.layer = layer
        self.gradient_placements = gradient_placements
        # Only a layer with units reads sharded variables (its first call
        # proved it); replicated reads skip the check.
        self.gathering = (
            unit_gathering.UnitGathering(units, resharding) if units else None
        )
        self.views = views

    def get_current_value(self, variable):
        view = self.state_mapping.get(id(variable))
        if view is None and self.views is not None:
            view = self._cached_view(variable)
        if view is not None:
            return view
        value = variable._value
        if self.gathering is not None and unit_gathering.is_sharded(
            value, self.gradient_placements
        ):
            # Not kept: freed as soon as forward is done with it.
            spec = self._gradient_spec(variable)
            return self.gathering.view(variable, value, spec)
        return self._replicated_view(variable, value)

    def _replicated_view(self, variable, value):
        """A new view of a replicated value, kept for the scope and, with
        gradients on, cached for the next calls."""
        if value.requires_grad:
            view = self._new_view(value, self._gradient_spec(variable))
        else:
            # No gradient to send back (a non-trainable variable): the
            # local tensor as `LocalView` gives it, without the autograd
            # function.
            view = torch_internals.local_tensor(value).detach()
        self.state_mapping[id(variable)] = view
        if self.views is not None and view.requires_grad:
            self.views[id(variable)] = CachedView(
                value,
                torch_internals.local_tensor(value),
                view,
                local_call_state.accumulating(),
            )
        return view

    def _new_view(self, value, spec):
        """The local view of a replicated value: a gradient leaf inside a
        step that accumulates into the variables (and caches views), else
        the output of `LocalView`."""
        if (
            local_call_state.accumulating()
            and self.views is not None
            and value.requires_grad
            and torch.is_grad_enabled()
        ):
            leaf = local_gradients.gradient_leaf(
                value, spec.placements, torch_internals.local_tensor(value)
            )
            if leaf is not None:
                return leaf
        return local_views.LocalView.apply(value, spec)

    def _cached_view(self, variable):
        """The view an earlier call made of this variable, if still good.

        A view reads the local tensor (it shares its storage and version
        counter, so it sees the optimizer's in-place updates) and sends
        its gradient to the variable's value, as a new view would. It is
        good while the variable holds the same value with the same local
        tensor, and is read with gradients on, as when it was made.
        """
        cached = self.views.get(id(variable))
        if cached is None:
            return None
        value, local, view, accumulating = cached
        if (
            variable._value is not value
            or torch_internals.local_tensor(value) is not local
            or not value.requires_grad
            or not torch.is_grad_enabled()
            # Views made for steps that accumulate may be gradient
            # leaves; other steps need views that lead back to the value.
            or accumulating != local_call_state.accumulating()
        ):
            return None
        self.state_mapping[id(variable)] = view
        return view

    def _gradient_spec(self, variable):
        """The spec of the gradient of the variable's local view.

        Made once per value and gradient placements, and cached per value
        (a DTensor whose placements never change; a sharded value's
        global shape and stride are its unsharded value's).
        """
        value = variable._value
        cache = local_call_state.caches().gradient_specs
        specs = cache.get(value)
        if specs is None:
            self._check_readable(variable, value)
            specs = {}
            cache[value] = specs
        spec = specs.get(self.gradient_placements)
        if spec is None:
            spec = local_views.tensor_spec(
                value.device_mesh, self.gradient_placements, value
            )
            specs[self.gradient_placements] = spec
        return spec

    def _check_readable(self, variable, value):
        """Raises unless the call may read `value` (checked once per
        value)."""
        placements = self.gradient_placements
        readable = unit_gathering.readable_locally(value, placements)
        sharded = unit_gathering.is_sharded(value, placements)
        if not readable or (self.gathering is None and sharded):
            raise RuntimeError(
                f"{describe(self.layer)} runs on local shards but "
                f"read variable '{variable.path}', which is neither "
                "replicated nor sharded over the batch axes only, and "
                "is not one of its variables."
            )

    def add_update(self, update):
        variable, _ = update
        raise RuntimeError(
            f"{describe(self.layer)} runs on local shards but assigned "
            f"variable '{variable.path}', which its first call did not."
        )

    def __exit__(self, *exc_info):
        try:
            if self.gathering is not None:
                # A unit gathered ahead but never read: its gather is
                # waited for.
                self.gathering.wait_prefetched()
        finally:
            super().__exit__(*exc_info)
