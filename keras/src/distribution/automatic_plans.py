"""Tensor-parallel plans derived from a model's structure.

`auto_tensor_parallel_plan(model, device_mesh, axis)` returns the plan
Megatron-LM would write for a model, for `tensor_parallel_layouts`, and
a report of one line per layer that owns variables;
`auto_tensor_parallel_layouts` returns the `LayoutMap` directly.

The layers' roles come from one symbolic call of the model (see
`layer_calls`): which layer received which tensor object, in which
order, and the shapes. Names are never read, so a model never seen
before is handled the same way:
- a *column group* is a run of consecutive `Dense`/`EinsumDense` calls
  on one tensor object: query/key/value, gate/up, or a fused
  query-key-value projection alone;
- its *row partner* is the next such call, on a new tensor (computed
  from the group's outputs), back to the group input's feature size;
- the group is split on its output-only dimension (heads, or features),
  the partner on its contracted one (`column_parallel`/`row_parallel`;
  the group sets no output layout: its outputs are split as computed).
  A member whose heads do not divide over the axis (grouped-query
  key/value heads) stays replicated; a group whose partner does not
  divide stays replicated whole;
- a layer whose variables share a leading dimension E, called on the
  input of a projection to E outputs (the router), holds E experts:
  they are split over the axis; the router stays replicated;
- an `Embedding` with more rows than columns (a token embedding, and
  the tied or untied head of a `ReversibleEmbedding`) is split on its
  vocabulary, or on its hidden size when the vocabulary does not divide;
- everything else (norms, position embeddings, projections without a
  partner) stays replicated, and the report says why.

Limits: operations between layer calls are not seen, so a row partner
is recognised by its place and shapes, not by a traced data path; a
layer that owns its projection weights instead of calling `Dense` or
`EinsumDense` (other than experts) is left replicated; inputs that a
layer casts before its own `call` (mixed dtypes) are different tensor
objects, so such a group is split up and its layers reported.

Nothing here depends on a backend.
"""

import collections
import functools
import logging
import re

from keras.src.api_export import keras_export
from keras.src.distribution import layer_calls
from keras.src.distribution import layout_composition
from keras.src.distribution import tensor_parallel
from keras.src.distribution.layout_composition import layer_path
from keras.src.layers.core.dense import Dense
from keras.src.layers.core.einsum_dense import EinsumDense
from keras.src.layers.core.embedding import Embedding

logger = logging.getLogger(__name__)

AutoPlan = collections.namedtuple("AutoPlan", ["plan", "report"])

# How a layer is laid out: its style (`None`: replicated), its role and
# why, for the report.
_Placement = collections.namedtuple("_Placement", ["style", "role", "why"])

_PROJECTIONS = (Dense, EinsumDense)


@keras_export("keras.distribution.auto_tensor_parallel_plan")
def auto_tensor_parallel_plan(model, device_mesh, axis="model", *, inputs=None):
    """Derives Megatron's tensor-parallel plan from a model's structure.

    The model is called once on abstract inputs; the roles of its layers
    are read from which tensors they receive and the shapes (rules and
    limits: module docstring). Call it before `set_distribution`.

    Example:

    ```python
    plan, report = auto_tensor_parallel_plan(model, mesh, "model")
    print("\\n".join(report))
    layout_map = tensor_parallel_layouts(model, mesh, plan)
    ```

    Args:
        model: a built Keras model, or an abstract one (built under
            `keras.StatelessScope()`).
        device_mesh: the `DeviceMesh`.
        axis: the mesh axis to split over.
        inputs: optional structure of `KerasTensor`s to call the model
            on; defaults to the model's inputs (see
            `layer_calls.traced_calls`).

    Returns:
        An `AutoPlan(plan, report)`: `plan` maps an exact layer path
        pattern to a style; `report` is a list of lines, one per layer
        that owns variables: its path, its style (`column`, `row`,
        `experts`, `vocabulary`, `hidden` or `replicated`), its role and
        why.

    Raises:
        ValueError: when `axis` is not an axis of the mesh, a
            distribution is set, or the model cannot be called (see
            `layer_calls.traced_calls`).
    """
    size = _axis_size(device_mesh, axis)
    calls = layer_calls.traced_calls(model, inputs)
    placements = _placements(calls, axis, size)
    ranks = {}
    for call in calls:
        shape = layer_calls.shape_of(call.output)
        ranks.setdefault(call.layer, None if shape is None else len(shape))
    plan = {
        re.escape(layer_path(layer)): _at_traced_rank(
            placement.style, ranks[layer]
        )
        for layer, placement in placements.items()
        if placement.style is not None
    }
    return AutoPlan(plan, _report(model, placements))


def _at_traced_rank(style, rank):
    """`style`, with the output layout at the rank the trace saw."""
    return functools.partial(_traced_rank_layouts, style=style, rank=rank)


def _traced_rank_layouts(layer, batch_dim_name, style, rank):
    """A style's layouts, the output's at the traced rank.

    A sublayer of a subclassed layer has no functional node, so the
    style reads its output rank from the shape it was built with; a
    layer built on `(batch, sequence, features)` may be called on
    `(tokens, features)` (a mixture of experts flattens its tokens).
    The first dimension keeps its entry, the last ones theirs.
    """
    entries = style(layer, batch_dim_name)
    key = f"{layer_path(layer)}/output"
    axes = entries.get(key)
    if axes is None or rank is None or len(axes) == rank:
        return entries
    tail = tuple(axes[1:])[len(axes) - rank :] if rank > 1 else ()
    entries[key] = (axes[0],) + (None,) * (rank - 1 - len(tail)) + tail
    return entries


@keras_export("keras.distribution.auto_tensor_parallel_layouts")
def auto_tensor_parallel_layouts(
    model,
    device_mesh,
    axis="model",
    *,
    layout_map=None,
    batch_dim_name=None,
    inputs=None,
):
    """Returns the `LayoutMap` of `auto_tensor_parallel_plan`'s plan.

    The report is logged at `INFO` level on this module's logger. A
    user's `layout_map` wins: each layer that has a variable or output
    it lays out is left out of the automatic plan, and the two maps are
    merged (see `merge_layouts`). For 2-D layouts, pass the result to
    `fully_sharded_layouts(model, mesh, "fsdp", layout_map=...)`.

    Example:

    ```python
    mesh = make_device_mesh({"fsdp": -1, "model": 2})
    with keras.StatelessScope():
        model = make_model()
        layout_map = fully_sharded_layouts(
            model, mesh, "fsdp",
            layout_map=auto_tensor_parallel_layouts(model, mesh, "model"),
        )
        set_distribution(ModelParallel(layout_map=layout_map))
    ```

    Args:
        model: a built or abstract Keras model.
        device_mesh: the `DeviceMesh`.
        axis: the mesh axis to split over.
        layout_map: optional `LayoutMap` of the user's own entries.
        batch_dim_name: the mesh axis of the batch of layer outputs;
            defaults to the mesh's first axis (see
            `tensor_parallel_layouts`).
        inputs: see `auto_tensor_parallel_plan`.

    Returns:
        A `LayoutMap`.

    Raises:
        ValueError: as `auto_tensor_parallel_plan`, and when the user's
            map does not fit a variable (see `merge_layouts`).
    """
    plan, report = auto_tensor_parallel_plan(
        model, device_mesh, axis, inputs=inputs
    )
    for line in report:
        logger.info("%s", line)
    if layout_map is not None:
        plan = _without_user_layers(model, plan, layout_map)
    automatic = tensor_parallel.tensor_parallel_layouts(
        model, device_mesh, plan, batch_dim_name=batch_dim_name
    )
    if layout_map is None:
        return automatic
    return layout_composition.merge_layouts(model, automatic, layout_map)


@keras_export("keras.distribution.expert_parallel")
def expert_parallel(axis="model"):
    """Returns a style that splits a layer's experts over `axis`.

    Every variable of the layer whose leading dimension is the layer's
    number of experts (the leading dimension its variables share) is
    sharded on it; the layer's output is left as computed.

    Args:
        axis: the mesh axis to split over.

    Returns:
        A style: a function `(layer, batch_dim_name) -> dict` for a plan.
        Applied by `tensor_parallel_layouts`, it raises a `ValueError`
        naming a layer whose variables do not share a leading dimension.
    """
    return functools.partial(expert_parallel_layouts, axis=axis)


def expert_parallel_layouts(layer, batch_dim_name, axis):
    """The layouts of `expert_parallel` for one layer (see there)."""
    count = _expert_count(layer)
    if count is None:
        raise ValueError(
            f"expert_parallel for layer '{layer_path(layer)}': its "
            "variables "
            f"{[(v.path, tuple(v.shape)) for v in _own_variables(layer)]} "
            "do not share a leading dimension of experts."
        )
    return {
        v.path: (axis,) + (None,) * (len(v.shape) - 1)
        for v in _own_variables(layer)
    }


def _axis_size(device_mesh, axis):
    names = tuple(device_mesh.axis_names)
    if axis not in names:
        raise ValueError(
            f"The axis '{axis}' is not an axis of the mesh "
            f"{dict(zip(names, device_mesh.shape))}."
        )
    return int(device_mesh.shape[names.index(axis)])


def _placements(calls, axis, size):
    """A `_Placement` for each layer the trace gives a role, in order."""
    placements = {}
    experts, routers = _experts_and_routers(calls)
    for layer, count in experts.items():
        placements[layer] = (
            _Placement(expert_parallel(axis), "experts", f"{count} experts")
            if count % size == 0
            else _Placement(
                None, "experts", _indivisible(count, "experts", axis, size)
            )
        )
    for layer in routers:
        placements[layer] = _Placement(None, "router", "routing")
    projections = [
        call
        for call in calls
        if isinstance(call.layer, _PROJECTIONS) and call.layer not in routers
    ]
    _place_blocks(projections, placements, axis, size)
    _place_embeddings(calls, placements, axis, size)
    return placements


def _place_blocks(projections, placements, axis, size):
    """Places each column group and its row partner (module docstring)."""
    index = 0
    while index < len(projections):
        first = projections[index]
        group = [first]
        while (
            index + len(group) < len(projections)
            and projections[index + len(group)].input is first.input
        ):
            group.append(projections[index + len(group)])
        index += len(group)
        partner = projections[index] if index < len(projections) else None
        if partner is None or not _closes(group, partner):
            for call in group:
                placements.setdefault(
                    call.layer,
                    _Placement(None, "projection", "no row-parallel partner"),
                )
            continue
        index += 1
        if any(c.layer in placements for c in group + [partner]):
            continue  # A layer called again (shared weights) keeps its role.
        _place_pair(group, partner, placements, axis, size)


def _closes(group, partner):
    """Whether `partner` is the row partner of the column `group`."""
    group_input = layer_calls.shape_of(group[0].input)
    partner_input = layer_calls.shape_of(partner.input)
    partner_output = layer_calls.shape_of(partner.output)
    if None in (group_input, partner_input, partner_output):
        return False
    if partner.input is group[0].input:
        return False
    # Computed from the group's outputs: no more features than they hold.
    features = _features(partner_input, len(group_input) - 1)
    produced = sum(
        _features(layer_calls.shape_of(call.output), len(group_input) - 1)
        for call in group
    )
    return (
        len(partner_output) == len(group_input)
        and partner_output[-1] == group_input[-1]
        and features <= produced
    )


def _features(shape, leading):
    """The number of features of `shape` after its `leading` dimensions."""
    count = 1
    for dim in (shape or ())[leading:]:
        count *= dim
    return count


def _place_pair(group, partner, placements, axis, size):
    """Places a column group and its row partner, or leaves them."""
    increases_rank = any(
        len(layer_calls.shape_of(c.output)) > len(layer_calls.shape_of(c.input))
        for c in group
    )
    role = "attention" if increases_rank or len(group) >= 3 else "MLP"
    row_size, problem = _split_size(partner.layer, axis, row=True)
    if problem is None and row_size % size:
        problem = _indivisible(row_size, "input features", axis, size)
    if problem is not None:
        for call in group + [partner]:
            placements[call.layer] = _Placement(None, role, problem)
        return
    widest = max(_split_size(c.layer, axis)[0] or 0 for c in group)
    for call in group:
        column_size, problem = _split_size(call.layer, axis)
        part = "key/value"
        if column_size == widest:
            part = "query/key/value" if role == "attention" else "up/gate"
        if problem is None and column_size % size:
            problem = _indivisible(column_size, "heads or features", axis, size)
        placements[call.layer] = (
            _Placement(None, f"{role} {part}", problem)
            if problem is not None
            else _Placement(
                _column_parallel(axis),
                f"{role} {part}",
                f"{column_size} split",
            )
        )
    placements[partner.layer] = _Placement(
        tensor_parallel.row_parallel(axis),
        f"{role} output",
        f"{row_size} split",
    )


def _column_parallel(axis):
    return functools.partial(_column_layouts, axis=axis)


def _column_layouts(layer, batch_dim_name, axis):
    """`column_parallel`'s layouts without the output's: a kernel split
    on its output-only dimension already gives an output split there, so
    the layout would only add a no-op constraint, forward and backward,
    to every call (`distribute_tensor`)."""
    entries = tensor_parallel.column_parallel_layouts(
        layer, batch_dim_name, axis
    )
    entries.pop(f"{layer_path(layer)}/output", None)
    return entries


def _split_size(layer, axis, row=False):
    """`(size, None)`: the kernel dimension a column (or row) split takes,
    or `(None, problem)` when the layer cannot be split."""
    layouts = (
        tensor_parallel.row_parallel_layouts
        if row
        else tensor_parallel.column_parallel_layouts
    )
    try:
        entries = layouts(layer, None, axis)
    except ValueError as error:
        return None, str(error)
    # The variable, not the `kernel` property (LoRA adds its product).
    kernel = next(v for v in layer.weights if v.name == "kernel")
    axes = entries[kernel.path]
    return int(kernel.shape[axes.index(axis)]), None


def _indivisible(count, what, axis, size):
    return f"{count} {what} do not divide over '{axis}' of size {size}"


def _experts_and_routers(calls):
    """`({expert layer: count}, {router layers})` of the trace.

    An expert layer's variables share a leading dimension E; a router is
    a projection to E outputs that received the same tensor, or is a
    sibling (same parent layer).
    """
    candidates = [
        call
        for call in calls
        if not isinstance(call.layer, _PROJECTIONS + (Embedding,))
        and _expert_count(call.layer)
    ]
    experts, routers = {}, set()
    for candidate in candidates:
        count = _expert_count(candidate.layer)
        parent = _parent(candidate.layer)
        for call in calls:
            output = layer_calls.shape_of(call.output)
            if (
                isinstance(call.layer, _PROJECTIONS)
                and output
                and output[-1] == count
                and (
                    call.input is candidate.input
                    or _parent(call.layer) == parent
                )
            ):
                experts[candidate.layer] = count
                routers.add(call.layer)
    return experts, routers


def _expert_count(layer):
    """The leading dimension all of a layer's variables share, if > 1."""
    variables = _own_variables(layer)
    if not variables or any(len(v.shape) < 3 for v in variables):
        return None
    leading = {int(v.shape[0]) for v in variables}
    if len(leading) != 1 or leading == {1}:
        return None
    return leading.pop()


def _own_variables(layer):
    return list(layer._trainable_variables) + list(
        layer._non_trainable_variables
    )


def _parent(layer):
    return layer_path(layer).rpartition("/")[0]


def _place_embeddings(calls, placements, axis, size):
    """Places each called `Embedding` not placed yet (module docstring)."""
    for call in calls:
        layer = call.layer
        if not isinstance(layer, Embedding) or layer in placements:
            continue
        rows, columns = (int(d) for d in layer.embeddings.shape)
        if rows <= columns:
            placements[layer] = _Placement(
                None, "embedding", f"small table ({rows} rows)"
            )
        elif rows % size == 0:
            placements[layer] = _Placement(
                _vocabulary_parallel(axis), "embedding", f"{rows} rows split"
            )
        elif columns % size == 0:
            placements[layer] = _Placement(
                _hidden_parallel(axis),
                "embedding",
                _indivisible(rows, "rows", axis, size) + "; columns split",
            )
        else:
            placements[layer] = _Placement(
                None, "embedding", _indivisible(rows, "rows", axis, size)
            )


def _vocabulary_parallel(axis):
    return functools.partial(_vocabulary_layouts, axis=axis)


def _vocabulary_layouts(layer, batch_dim_name, axis):
    """The vocabulary split of an embedding, and of its reversed head.

    No output layout: a tied head's logits are this layer's output too,
    and left split along the vocabulary they reach the cross-entropy
    ungathered (a lookup's result is whole as it is made)."""
    entries = tensor_parallel.row_parallel_layouts(layer, batch_dim_name, axis)
    entries.pop(f"{layer_path(layer)}/output", None)
    reverse = getattr(layer, "reverse_embeddings", None)
    if reverse is not None:
        entries[reverse.path] = (None, axis)
    return entries


def _hidden_parallel(axis):
    return functools.partial(_hidden_layouts, axis=axis)


def _hidden_layouts(layer, batch_dim_name, axis):
    """The hidden-size split of an embedding (output gathered)."""
    entries = tensor_parallel.column_parallel_layouts(
        layer, batch_dim_name, axis, gather_output=True
    )
    reverse = getattr(layer, "reverse_embeddings", None)
    if reverse is not None:
        entries[reverse.path] = (axis, None)
    return entries


_STYLE_NAMES = {
    _column_layouts: "column",
    tensor_parallel.row_parallel_layouts: "row",
    expert_parallel_layouts: "experts",
    _vocabulary_layouts: "vocabulary",
    _hidden_layouts: "hidden",
}


def _report(model, placements):
    """One line per layer that owns variables: path, style, role, why."""
    lines = []
    for layer in layout_composition.called_layers(model):
        if not _own_variables(layer):
            continue
        placement = placements.get(layer)
        if placement is None:
            lines.append(f"{layer_path(layer)}: replicated, {_unplaced(layer)}")
            continue
        style = "replicated"
        if placement.style is not None:
            style = _STYLE_NAMES[placement.style.func]
        lines.append(
            f"{layer_path(layer)}: {style}, {placement.role} ({placement.why})"
        )
    return lines


def _unplaced(layer):
    if all(len(v.shape) <= 1 for v in _own_variables(layer)):
        return "norm or scale"
    return f"no role found ({type(layer).__name__})"


def _without_user_layers(model, plan, layout_map):
    """`plan` without the layers `layout_map` lays out a key of."""
    # The plan's keys are escaped layer paths.
    layers = {
        re.escape(layer_path(layer)): layer
        for layer in layout_composition.called_layers(model)
    }
    kept = {}
    for pattern, style in plan.items():
        layer = layers[pattern]
        keys = [v.path for v in layer.weights]
        keys.append(f"{layer_path(layer)}/output")
        if not any(
            layout_composition.matching_keys(layout_map, key) for key in keys
        ):
            kept[pattern] = style
    return kept
