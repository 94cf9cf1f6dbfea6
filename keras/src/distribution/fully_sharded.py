"""Fully-sharded (FSDP-style) layouts for every large variable of a model.

`fully_sharded_layouts` picks, for each variable, the dimension to shard
over a data-parallel mesh axis, as PyTorch's `fully_shard` does for
parameters, and returns the result as a `LayoutMap`. It composes with
tensor-parallel layouts: given a base `LayoutMap`, variables keep the
axes they already have, and the new axis is added as the minor one.

The largest dimension that divides by the size of `axis` is sharded
over it (the first one on a tie). Variables already sharded on other
axes (by the base layout) keep those axes; a dimension already
sharded takes `axis` too, as its minor axis, only when its size
divides by the product of all its axis sizes. Variables with fewer
than `min_size` elements, variables with no suitable dimension, and
variables left out by `include` or `exclude` are not sharded over
`axis`; nothing is, when `axis` has size 1.

Example:

```python
mesh = DeviceMesh((2, 4), ("fsdp", "model"), devices)
with keras.StatelessScope():  # variables get shapes, not memory
    model = make_model()
    layout_map = fully_sharded_layouts(model, mesh, "fsdp")
    set_distribution(ModelParallel(layout_map=layout_map))
# Leaving the scope creates every variable, sharded.
```

Nothing here depends on a backend.
"""

import logging
import math
import re

from keras.src.api_export import keras_export
from keras.src.distribution import layout_composition
from keras.src.distribution import layout_validation

DEFAULT_MIN_SIZE = 2**14

logger = logging.getLogger(__name__)


@keras_export("keras.distribution.fully_sharded_layouts")
def fully_sharded_layouts(
    model,
    device_mesh=None,
    axis="fsdp",
    *,
    min_size=DEFAULT_MIN_SIZE,
    include=None,
    exclude=None,
    layout_map=None,
):
    """Returns layouts that shard each large variable over a mesh axis.

    Each variable's largest dimension that divides by the size of `axis`
    is sharded over it (rules and example: module docstring), logged at
    `INFO` level on this module's logger.

    Args:
        model: a built Keras model, an abstract one (built under
            `keras.StatelessScope()`), or a dict from variable path to
            shape.
        device_mesh: the `DeviceMesh`. May be omitted when `layout_map`
            is given.
        axis: the mesh axis to shard over.
        min_size: the number of elements below which a variable is not
            sharded over `axis`.
        include: optional regex(es); only variables whose path
            `re.fullmatch`es one are sharded.
        exclude: optional regex(es); variables whose path matches one
            are not sharded over `axis`.
        layout_map: optional base `LayoutMap` (e.g. from
            `tensor_parallel_layouts`), kept and refined.

    Returns:
        A new `LayoutMap`: `layout_map`'s entries, and a key per variable.

    Raises:
        ValueError: if `axis` is not a mesh axis, the meshes differ, or a
            base layout does not fit its variable.
    """
    device_mesh = _resolve_mesh(device_mesh, layout_map, axis)
    sizes = layout_validation.mesh_axis_sizes(device_mesh)
    include = _patterns(include, "include")
    exclude = _patterns(exclude, "exclude")
    entries = {}
    if layout_map is not None:
        entries.update(layout_composition.layout_map_axes(layout_map))
    for path, shape in layout_composition.variable_shapes(model).items():
        base = None
        if layout_map is not None:
            base = layout_composition.resolve_layout(layout_map, path, shape)
            if base is not None:
                layout_validation.check_layout(path, shape, base, device_mesh)
        axes = _logged_axes(
            path, shape, base, axis, sizes, min_size, include, exclude
        )
        if axes is not None:
            entries[path] = axes
    result = layout_composition.build_layout_map(device_mesh, entries)
    layout_composition.check_layouts(model, result)
    return result


def sharded_axes(path, shape, base, axis, sizes, min_size, include, exclude):
    """Decides the layout of one variable (the rules are in the module
    docstring).

    Args:
        path: the variable path.
        shape: the variable shape.
        base: its axes before sharding over `axis`, or `None`.
        axis: the mesh axis to add.
        sizes: dict from mesh axis name to size.
        min_size: the number of elements below which nothing is added.
        include: list of compiled regexes, or `None` for all.
        exclude: list of compiled regexes.

    Returns:
        A tuple `(axes, reason)`: the resulting axes (`None` when the
        variable stays replicated) and the decision, in words.
    """
    axes = list(base) if base is not None else [None] * len(shape)
    unchanged = tuple(axes) if base is not None else None
    used = {
        name
        for entry in axes
        for name in layout_validation.axis_names_of(entry)
    }
    if include is not None and not _matches(include, path):
        return unchanged, "not sharded: no include pattern matches"
    if _matches(exclude, path):
        return unchanged, "not sharded: an exclude pattern matches"
    if axis in used:
        return unchanged, f"kept: already sharded over {axis!r}"
    if sizes[axis] == 1:
        return unchanged, f"not sharded: mesh axis {axis!r} has size 1"
    size = math.prod(shape)
    if size < min_size:
        return unchanged, (
            f"not sharded: {size} elements is below min_size={min_size}"
        )
    by_size = sorted(range(len(shape)), key=lambda dim: (-shape[dim], dim))
    for dim in by_size:
        names = layout_validation.axis_names_of(axes[dim])
        parts = math.prod(sizes[name] for name in names) * sizes[axis]
        if shape[dim] % parts == 0:
            names += (axis,)
            axes[dim] = names[0] if len(names) == 1 else names
            return tuple(axes), (
                f"dimension {dim} of size {shape[dim]} sharded over "
                f"{' x '.join(repr(n) for n in names)}"
            )
    return unchanged, (
        f"not sharded: no dimension of {shape} divides by the size of "
        f"{axis!r} ({sizes[axis]}) times its existing axes"
    )


def _logged_axes(path, shape, base, axis, sizes, min_size, include, exclude):
    """`sharded_axes` of one variable, with its decision logged at INFO."""
    axes, reason = sharded_axes(
        path, shape, base, axis, sizes, min_size, include, exclude
    )
    logger.info(
        "fully_sharded_layouts: variable '%s' with shape %s: %s; "
        "layout axes %s.",
        path,
        shape,
        reason,
        axes,
    )
    return axes


def _resolve_mesh(device_mesh, layout_map, axis):
    """The mesh of the layouts, which must have `axis`."""
    if layout_map is None:
        if device_mesh is None:
            raise ValueError("Pass a `device_mesh` or a base `layout_map`.")
    elif device_mesh is None:
        device_mesh = layout_map.device_mesh
    elif not layout_composition.same_mesh(device_mesh, layout_map.device_mesh):
        raise ValueError(
            f"The mesh {device_mesh} differs from the mesh of the base "
            f"layout_map, {layout_map.device_mesh}."
        )
    if axis not in device_mesh.axis_names:
        raise ValueError(
            f"Axis {axis!r} is not an axis of the mesh {device_mesh}. "
            f"Mesh axes: {tuple(device_mesh.axis_names)}"
        )
    return device_mesh


def _patterns(patterns, name):
    if patterns is None:
        return None if name == "include" else []
    if isinstance(patterns, str):
        patterns = [patterns]
    try:
        return [re.compile(pattern) for pattern in patterns]
    except (re.error, TypeError) as error:
        raise ValueError(
            f"`{name}` must be a regex or a list of regexes. "
            f"Received: {name}={patterns} ({error})"
        ) from None


def _matches(patterns, path):
    return any(pattern.fullmatch(path) for pattern in patterns)
