"""Checking a layout against a tensor shape and a device mesh.

One validator for every place that meets a layout: the layout helpers
check whole `LayoutMap`s with it before variables exist, and the torch
backend checks each variable, output and batch layout with it as it
distributes them. Each check raises a `ValueError` naming the variable
path, its shape, the layout axes, the mesh and the offending axis.

Everything here is backend-agnostic: it reads shapes and mesh axis sizes
only.
"""

import math

from keras.src.distribution.distribution_lib import TensorLayout


def normalize_axes(axes):
    """Returns layout axes as a tuple of `None`, names and name tuples.

    A dimension over one mesh axis is the axis name; over several, a tuple
    of names (the first is the major one); unsharded, `None`.
    """
    if isinstance(axes, TensorLayout):
        axes = axes.axes
    normalized = []
    for entry in axes:
        if isinstance(entry, (tuple, list)):
            entry = tuple(entry)
            if not entry:
                entry = None
            elif len(entry) == 1:
                entry = entry[0]
        normalized.append(entry)
    return tuple(normalized)


def axis_names_of(entry):
    """Returns the mesh axis names of one layout entry, as a tuple."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def mesh_axis_sizes(device_mesh):
    """Returns a dict from mesh axis name to its size."""
    return dict(zip(device_mesh.axis_names, device_mesh.shape))


def mesh_text(device_mesh):
    """The mesh as messages name it: `DeviceMesh({'batch': 2, ...})`."""
    if device_mesh is None:
        return "None"
    shape = dict(zip(device_mesh.axis_names, device_mesh.shape))
    return f"DeviceMesh({shape})"


def layout_error(path, shape, axes, device_mesh, reason, kind="variable"):
    """Formats the message of an invalid layout.

    Args:
        path: the variable path or layout key, or `None` for an unnamed
            tensor.
        shape: the variable shape, or `None` for a tensor of unknown shape.
        axes: the layout axes.
        device_mesh: the `DeviceMesh`.
        reason: what is wrong, naming the offending axis.
        kind: `"variable"` or `"tensor"`.

    Returns:
        The message (str).
    """
    name = f"{kind} '{path}'" if path is not None else kind
    shape_text = f" with shape {tuple(shape)}" if shape is not None else ""
    return (
        f"Invalid layout for {name}{shape_text}: layout axes "
        f"{tuple(axes)} on mesh {mesh_text(device_mesh)}: {reason}."
    )


def check_layout(
    path, shape, axes, device_mesh, kind="variable", require_divisible=True
):
    """Checks one layout against a shape and a mesh.

    Every axis must be a mesh axis used at most once; with a known shape,
    the rank must match and each sharded dimension must divide by the
    product of its mesh axis sizes.

    Args:
        path: the variable path or layout key, for the message.
        shape: the shape, or `None` when unknown (layer outputs).
        axes: the layout axes.
        device_mesh: the `DeviceMesh`.
        kind: `"variable"` or `"tensor"`, for the message.
        require_divisible: whether each sharded dimension must divide by
            its axis sizes (variables must; a data batch may be split
            unevenly).

    Raises:
        ValueError: naming the path, shape, axes, mesh and offending axis.
    """
    axes = normalize_axes(axes)
    sizes = mesh_axis_sizes(device_mesh)

    def fail(reason):
        raise ValueError(
            layout_error(path, shape, axes, device_mesh, reason, kind)
        )

    if shape is not None and len(axes) != len(shape):
        fail(
            f"the layout has {len(axes)} axes but the {kind} has rank "
            f"{len(shape)}"
        )
    used = {}
    for dim, entry in enumerate(axes):
        for name in axis_names_of(entry):
            if name not in sizes:
                fail(
                    f"axis {name!r} is not a mesh axis; the mesh axes are "
                    f"{tuple(device_mesh.axis_names)}"
                )
            if name in used:
                fail(
                    f"axis {name!r} shards both dimension {used[name]} and "
                    f"dimension {dim}; a mesh axis may be used once"
                )
            used[name] = dim
    if shape is None or not require_divisible:
        return
    for dim, entry in enumerate(axes):
        names = axis_names_of(entry)
        parts = math.prod(sizes[name] for name in names)
        if names and shape[dim] % parts:
            fail(
                f"dimension {dim} of size {shape[dim]} is not divisible by "
                f"{parts}, the size of mesh axis "
                f"{' x '.join(repr(n) for n in names)}"
            )
