"""Building, merging and checking `LayoutMap`s before variables exist.

The layout helpers (`tensor_parallel_layouts`, `fully_sharded_layouts`)
produce `LayoutMap`s. This module holds what they share: reading the
variables of a built or abstract model, turning layout axes into
`TensorLayout`s, and checking every variable of a model against a
`LayoutMap` so that a bad layout fails with a clear `ValueError` before
any variable is created.

Everything here is backend-agnostic: it reads paths, shapes and mesh axis
sizes only.
"""

import collections
import math
import re

import numpy as np

from keras.src.api_export import keras_export
from keras.src.distribution.distribution_lib import DeviceMesh
from keras.src.distribution.distribution_lib import LayoutMap
from keras.src.distribution.distribution_lib import TensorLayout
from keras.src.distribution.distribution_lib import list_devices
from keras.src.distribution.layout_validation import axis_names_of
from keras.src.distribution.layout_validation import check_layout
from keras.src.distribution.layout_validation import mesh_text
from keras.src.distribution.layout_validation import normalize_axes


@keras_export("keras.distribution.make_device_mesh")
def make_device_mesh(axis_sizes, devices=None):
    """Creates a `DeviceMesh` from a dict of axis names to sizes.

    One size may be `-1`: that axis takes all the devices the others leave,
    so the same call builds a `(1, 2)` mesh on 2 devices and a `(2, 2)` mesh
    on 4.

    Example:

    ```python
    mesh = make_device_mesh({"fsdp": -1, "model": 2})
    ```

    Args:
        axis_sizes: dict from mesh axis name to its size, in mesh order.
        devices: optional list of devices. Defaults to
            `keras.distribution.list_devices()`.

    Returns:
        A `keras.distribution.DeviceMesh`.

    Raises:
        ValueError: if `axis_sizes` is empty, a size is neither positive
            nor `-1`, more than one size is `-1`, or the sizes do not fit
            the number of devices.
    """
    if not axis_sizes:
        raise ValueError(
            "`axis_sizes` must name at least one mesh axis. "
            f"Received: axis_sizes={axis_sizes}"
        )
    if devices is None:
        devices = list_devices()
    devices = list(np.ravel(np.asarray(devices)))
    names = tuple(axis_sizes)
    sizes = [int(size) for size in axis_sizes.values()]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(
            "Each mesh axis size must be a positive integer, and at most one "
            f"may be -1. Received: axis_sizes={axis_sizes}"
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"Cannot build a mesh with axis_sizes={axis_sizes} from "
                f"{len(devices)} devices: {len(devices)} is not divisible "
                f"by {known}."
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"Cannot build a mesh with axis_sizes={axis_sizes} from "
            f"{len(devices)} devices: the mesh needs {math.prod(sizes)}."
        )
    return DeviceMesh(tuple(sizes), names, devices)


def variable_shapes(model):
    """Returns an ordered dict from variable path to shape.

    Args:
        model: a built Keras layer or model, an abstract one (built under
            `keras.StatelessScope()`, whose variables have shapes but no
            values), a dict from variable path to shape, or a list of
            variables.

    Returns:
        An `OrderedDict` from variable path (str) to shape (tuple of ints).
    """
    if isinstance(model, collections.abc.Mapping):
        items = model.items()
    else:
        variables = getattr(model, "variables", model)
        try:
            items = [(v.path, v.shape) for v in variables]
        except (AttributeError, TypeError):
            raise ValueError(
                "Expected a Keras layer or model, a dict from variable path "
                "to shape, or a list of variables. "
                f"Received: model={model}"
            ) from None
    shapes = collections.OrderedDict()
    for path, shape in items:
        shape = tuple(int(d) for d in shape)
        if path in shapes and shapes[path] != shape:
            raise ValueError(
                f"Two variables share the path '{path}' with different "
                f"shapes {shapes[path]} and {shape}: a LayoutMap cannot tell "
                "them apart. Give the layers distinct names."
            )
        shapes[path] = shape
    return shapes


def layer_output_paths(model):
    """Returns the `<layer path>/output` keys of a model's layers.

    Args:
        model: a Keras layer or model; anything else has no layer outputs.

    Returns:
        A list of keys, in layer order.
    """
    return [f"{layer_path(layer)}/output" for layer in called_layers(model)]


def called_layers(model):
    """Returns the layers of a model that have a path, the model included.

    Args:
        model: a Keras layer or model; anything else has no layers.

    Returns:
        A list of layers.
    """
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return []
    return [
        layer
        for layer in flatten(include_self=True, recursive=True)
        if layer_path(layer)
    ]


def layer_path(layer):
    """Returns the path a layer is called under, or `None` before a call.

    This is the path its variables and its `<path>/output` key start with.
    Layers without variables are never built, so their path is read from
    the name scope they were first called in.
    """
    if layer.path:
        return layer.path
    parent = getattr(layer, "_parent_path", None)
    if parent is None:
        return None
    return f"{parent}/{layer.name}" if parent else layer.name


def matching_keys(layout_map, path):
    """Returns the keys of `layout_map` that `LayoutMap` would use for `path`.

    An exact key wins; otherwise every key that `re.fullmatch`es the path.
    (`path in layout_map` cannot tell: `LayoutMap` lookup never raises
    `KeyError`.)
    """
    keys = list(layout_map)
    if path in keys:
        return [path]
    return [key for key in keys if re.fullmatch(key, path)]


def resolve_layout(layout_map, path, shape=None, kind="variable"):
    """Returns the axes `LayoutMap` lookup gives `path`, or `None`.

    Raises:
        ValueError: when several keys match, naming them and their axes.
    """
    keys = matching_keys(layout_map, path)
    if len(keys) > 1:
        shape_text = f" with shape {tuple(shape)}" if shape is not None else ""
        matches = ", ".join(
            f"{key!r} -> {normalize_axes(layout_map[key])}" for key in keys
        )
        raise ValueError(
            f"Conflicting layout keys for {kind} '{path}'{shape_text} on "
            f"mesh {mesh_text(layout_map.device_mesh)}: it matches "
            f"{matches}. Each path may match at most one key."
        )
    if not keys:
        return None
    return normalize_axes(layout_map[keys[0]])


@keras_export("keras.distribution.check_layouts")
def check_layouts(model, layout_map):
    """Checks every variable and layer output of a model against a map.

    This runs the checks variable creation would run, and the ones it
    would miss, before any memory is touched: every variable path must
    match at most one key, and its layout must fit its shape on the mesh
    (see `check_layout`). Layer output keys are checked for ambiguity and
    axis names.

    Args:
        model: a built or abstract Keras model, or a dict from variable
            path to shape (see `variable_shapes`).
        layout_map: the `LayoutMap`.

    Returns:
        A dict from variable path to its resolved axes (`None` where the
        variable is replicated).

    Raises:
        ValueError: naming the variable path, shape, axes, mesh and
            offending axis.
    """
    device_mesh = layout_map.device_mesh
    resolved = {}
    for path, shape in variable_shapes(model).items():
        axes = resolve_layout(layout_map, path, shape)
        if axes is not None:
            check_layout(path, shape, axes, device_mesh)
        resolved[path] = axes
    for path in layer_output_paths(model):
        axes = resolve_layout(layout_map, path, kind="tensor")
        if axes is not None:
            check_layout(path, None, axes, device_mesh, kind="tensor")
    for key in layout_map:
        check_layout(key, None, layout_map[key], device_mesh, kind="tensor")
    return resolved


class LiteralKeysLayoutMap(LayoutMap):
    """A `LayoutMap` whose misses try as regexes only the keys that can
    match more than themselves.

    `LayoutMap` tries every key as a regex when no key equals the path
    asked for, and every layer call asks for its output's layout. A map
    built from a model holds one literal key per variable and output
    (hundreds in a deep model), so each miss cost one regex match per
    key, every step. A key without regex metacharacters fully matches
    only itself, which the exact lookup already tried: the answers are
    `LayoutMap`'s.
    """

    def __init__(self, device_mesh):
        super().__init__(device_mesh)
        self._patterns = None  # The keys that are not literal, once known.

    def __getitem__(self, key):
        if key in self._layout_map:
            return self._layout_map[key]
        if self._patterns is None:
            self._patterns = [k for k in self._layout_map if re.escape(k) != k]
        matching = [p for p in self._patterns if re.fullmatch(p, key)]
        if len(matching) > 1:
            # `LayoutMap.__getitem__`'s error.
            raise ValueError(
                f"Path '{key}' matches multiple layout "
                f"specification keys: {matching}. Please make "
                "sure each tensor/variable path only matches at most "
                "one layout specification key in the LayoutMap."
            )
        return self._layout_map[matching[0]] if matching else None

    def __setitem__(self, key, layout):
        super().__setitem__(key, layout)
        self._patterns = None

    def __delitem__(self, key):
        self._patterns = None
        return super().__delitem__(key)


def build_layout_map(device_mesh, entries):
    """Builds a `LayoutMap` from a dict of keys to layout axes.

    Args:
        device_mesh: the `DeviceMesh` of the map.
        entries: dict from key (variable path, `<layer path>/output` or a
            regex) to axes or `TensorLayout`.

    Returns:
        A `LiteralKeysLayoutMap`.
    """
    layout_map = LiteralKeysLayoutMap(device_mesh)
    for key, axes in entries.items():
        axes = normalize_axes(axes)
        check_layout(key, None, axes, device_mesh, kind="tensor")
        layout_map[key] = tensor_layout(axes, device_mesh)
    return layout_map


def tensor_layout(axes, device_mesh):
    """Returns a `TensorLayout`, allowing dimensions over several axes.

    Outside the torch backend, `TensorLayout` in keras 3.15 validates each
    entry as a single axis name, though JAX's `PartitionSpec` accepts a
    tuple of names. The axes here have been checked by `check_layout`, so
    the mesh is attached without that validation.
    """
    axes = normalize_axes(axes)
    if not any(isinstance(entry, tuple) for entry in axes):
        return TensorLayout(axes, device_mesh)
    layout = TensorLayout(axes)
    layout._device_mesh = device_mesh
    return layout


@keras_export("keras.distribution.layout_map_axes")
def layout_map_axes(layout_map):
    """Returns a plain dict from each key of a `LayoutMap` to its axes.

    Handy for printing or comparing maps: each `TensorLayout` becomes its
    axes as a tuple, where a dimension over one mesh axis is the axis name,
    over several a tuple of names, and unsharded `None`.

    Example:

    ```python
    layout_map = LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    layout_map_axes(layout_map)  # {"dense/kernel": (None, "model")}
    ```

    Args:
        layout_map: a `keras.distribution.LayoutMap`.

    Returns:
        A dict from each key of `layout_map`, in its order, to a tuple of
        axes.
    """
    return {key: normalize_axes(layout_map[key]) for key in layout_map}


def combine_axes(axes, other):
    """Returns a layout that keeps the shardings of both, or `None`.

    Dimension by dimension, the mesh axes of one layout must be a prefix
    of the other's (an axis added later is the minor one), and the longer
    one is kept: `(None, "model")` and `("fsdp", None)` combine into
    `("fsdp", "model")`, and `(None, "model")` and
    `(None, ("model", "fsdp"))` into the latter. Layouts of different
    ranks, or that split one dimension differently, do not combine.
    """
    axes, other = normalize_axes(axes), normalize_axes(other)
    if len(axes) != len(other):
        return None
    combined = []
    for entry, other_entry in zip(axes, other):
        names, other_names = axis_names_of(entry), axis_names_of(other_entry)
        if len(names) < len(other_names):
            names, other_names = other_names, names
            entry = other_entry
        if names[: len(other_names)] != other_names:
            return None
        combined.append(entry)
    return tuple(combined)


@keras_export("keras.distribution.merge_layouts")
def merge_layouts(model, *layout_maps):
    """Merges `LayoutMap`s into one, checking every variable of a model.

    Maps made by the layout helpers (`tensor_parallel_layouts`,
    `fully_sharded_layouts`) and by hand compose here. Where several maps
    give a variable or key a layout, the layouts are combined dimension
    by dimension (see `combine_axes`): a dimension sharded in one map
    only keeps that sharding, and where both shard it, one's mesh axes
    must extend the other's with minor axes, as `fully_sharded_layouts`
    does on top of a tensor-parallel map. Each variable of `model` gets an
    exact key in the result, so regex keys of different maps cannot
    collide on it. The result is checked like `check_layouts`.

    Example:

    ```python
    layout_map = merge_layouts(
        model,
        tensor_parallel_layouts(model, mesh, plan),
        fully_sharded_layouts(model, mesh, "fsdp"),
    )
    ```

    Args:
        model: a built or abstract Keras model, or a dict from variable
            path to shape (see `variable_shapes`).
        *layout_maps: `LayoutMap`s on the same mesh.

    Returns:
        A new `LayoutMap`.

    Raises:
        ValueError: on different meshes, on a key or variable whose
            layouts split a dimension differently, on an axis used twice
            or an indivisible dimension, naming the variable path, shape
            and axes.
    """
    device_mesh = _common_mesh(layout_maps)
    shapes = variable_shapes(model)
    entries = {}
    for path, shape in shapes.items():
        merged = _merged_variable_axes(path, shape, layout_maps, device_mesh)
        if merged is not None:
            entries[path] = merged
    for layout_map in layout_maps:
        for key in layout_map:
            if key in shapes:
                continue
            entries[key] = _merged_axes(
                key,
                None,
                entries.get(key),
                normalize_axes(layout_map[key]),
                device_mesh,
                kind="tensor",
            )
    result = build_layout_map(device_mesh, entries)
    check_layouts(model, result)
    return result


def _common_mesh(layout_maps):
    """The mesh every map of `layout_maps` uses (they must share one)."""
    if not layout_maps:
        raise ValueError("`merge_layouts` needs at least one LayoutMap.")
    device_mesh = layout_maps[0].device_mesh
    for layout_map in layout_maps[1:]:
        if not same_mesh(layout_map.device_mesh, device_mesh):
            raise ValueError(
                "All LayoutMaps must use the same mesh. Received meshes "
                f"{mesh_text(device_mesh)} and "
                f"{mesh_text(layout_map.device_mesh)}."
            )
    return device_mesh


def _merged_variable_axes(path, shape, layout_maps, device_mesh):
    """The merged axes of one variable over every map, or `None`."""
    merged = None
    for layout_map in layout_maps:
        axes = resolve_layout(layout_map, path, shape)
        if axes is not None:
            check_layout(path, shape, axes, device_mesh)
            merged = _merged_axes(path, shape, merged, axes, device_mesh)
    if merged is not None:
        check_layout(path, shape, merged, device_mesh)
    return merged


def same_mesh(mesh, other):
    """Whether two `DeviceMesh`es have the same shape, axes and devices."""
    if mesh is other:
        return True
    if mesh is None or other is None:
        return False
    return (
        tuple(mesh.shape) == tuple(other.shape)
        and tuple(mesh.axis_names) == tuple(other.axis_names)
        and np.array_equal(
            np.asarray(mesh.devices, dtype=str),
            np.asarray(other.devices, dtype=str),
        )
    )


def _merged_axes(path, shape, axes, other, device_mesh, kind="variable"):
    """Returns the combination of two layouts (see `combine_axes`)."""
    if axes is None:
        return other
    combined = combine_axes(axes, other)
    if combined is not None:
        return combined
    shape_text = f" with shape {tuple(shape)}" if shape is not None else ""
    raise ValueError(
        f"Conflicting layouts for {kind} '{path}'{shape_text} on mesh "
        f"{mesh_text(device_mesh)}: layout axes {axes} and {other} split "
        "a dimension differently, so they cannot be merged."
    )
