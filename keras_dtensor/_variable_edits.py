"""The post-import edits of variables and of the distribution API.

Under the torch backend, a `Variable` is laid out at creation (shard by
shard where it is sharded), on every assignment, and inside a layer's
`build` as outside it; its repr and `convert_to_numpy` show the whole
value; `distribution_lib`'s module binding is the torch one; a
`TensorLayout` takes a dimension over several mesh axes; and
`set_distribution` shares the random seed. UPSTREAMING.md lists each
edit with the in-tree change it stands for.
"""

import functools

from keras_dtensor import _edit_support as support


def edit_backend_distribution_lib(backend_module):
    """`keras.src.backend.distribution_lib` is the torch module, not None."""
    if support.is_torch_backend():
        backend_module.distribution_lib = support.torch_distribution_lib()


def edit_distribution_api_binding(module):
    """`keras.distribution` binds the torch `distribution_lib`.

    Needed only when keras was imported before the mount was armed.
    """
    if support.is_torch_backend() and module.distribution_lib is None:
        module.distribution_lib = support.torch_distribution_lib()


def edit_tensor_layout_multi_axis(module):
    """`TensorLayout` accepts a dimension sharded over several mesh axes.

    As with JAX's `PartitionSpec`, an entry of `axes` may be a tuple of mesh
    axis names, e.g. `(("batch", "model"), None)`.
    """
    if not support.is_torch_backend():
        return

    def _validate_axes(self):
        if not self._device_mesh:
            return
        valid_axis_names = set(self._device_mesh.axis_names)
        axis_names = set()
        for entry in self._axes:
            if isinstance(entry, (tuple, list)):
                axis_names.update(entry)
            elif entry is not None:
                axis_names.add(entry)
        if axis_names - valid_axis_names:
            raise ValueError(
                "Invalid axis names for Layout. Valid axis "
                f"names: {valid_axis_names}, Got {axis_names}"
            )

    module.TensorLayout._validate_axes = _validate_axes


def _resolve_variable_layout(variable, distribution):
    """Sets a variable's layout from `distribution` if it has none.

    Returns whether the variable has a layout: an explicit `layout=`
    argument, else the distribution's `get_variable_layout`.
    """
    if variable._layout is None and distribution is not None:
        variable._layout = distribution.get_variable_layout(variable)
    return variable._layout is not None


def edit_variable_initialize(core):
    """Variables are created as DTensor parameters in their layout.

    The layout is an explicit `layout=` argument, else the active
    distribution's `get_variable_layout`; with neither, creation is
    upstream's.
    """
    current_distribution = support.distribution_accessor()

    upstream_initialize = core.Variable._initialize

    def _initialize(self, value):
        distribution = current_distribution()
        if self._layout is None and distribution is not None:
            # `get_variable_layout` reads the shape, which may not be set yet.
            self._shape = self._validate_shape(value.shape)
        if not _resolve_variable_layout(self, distribution):
            return upstream_initialize(self, value)
        value = core.convert_to_tensor(value, dtype=self._dtype)
        self._value = support.torch_distribution_lib().distribute_variable(
            value, self._layout, trainable=self.trainable, path=self.path
        )

    core.Variable._initialize = _initialize


def edit_variable_initialize_shard_by_shard(core):
    """A sharded variable's initializer runs on its shard, not in full.

    Where the layout shards the variable and the initializer splits into
    rows (`sharded_initialization`), each process computes only its shard;
    otherwise the value is computed in full, as upstream does.
    """
    current_distribution = support.distribution_accessor()

    upstream_initialize_with_initializer = (
        core.Variable._initialize_with_initializer
    )

    def _initialize_with_initializer(self, initializer):
        if _resolve_variable_layout(self, current_distribution()):
            shard = support.torch_distribution_lib().initialize_variable_shard(
                initializer, self._shape, self._dtype, self._layout, self.path
            )
            if shard is not None:
                return self._initialize(shard)
        return upstream_initialize_with_initializer(self, initializer)

    core.Variable._initialize_with_initializer = _initialize_with_initializer


def edit_variable_assign(core):
    """Every assignment to a distributed variable keeps its layout."""
    from torch.distributed.tensor import DTensor

    upstream_direct_assign = core.Variable._direct_assign

    def _direct_assign(self, value):
        if isinstance(self._value, DTensor):
            support.torch_distribution_lib().assign_to_variable(
                self._value, value
            )
        else:
            upstream_direct_assign(self, value)

    core.Variable._direct_assign = _direct_assign


def edit_variable_repr(core):
    """A distributed variable's repr shows its placements, not its values.

    Printing the values would gather them: a collective that hangs when one
    process prints alone.
    """
    from torch.distributed.tensor import DTensor

    upstream_repr = core.Variable.__repr__

    def __repr__(self):
        value = getattr(self, "_value", None)
        if not isinstance(value, DTensor):
            return upstream_repr(self)
        return (
            f"<Variable path={self.path}, shape={self.shape}, "
            f"dtype={self.dtype}, placements={tuple(value.placements)}, "
            f"local_shape={tuple(value.to_local().shape)}>"
        )

    core.Variable.__repr__ = __repr__


def edit_convert_to_numpy(core):
    """`convert_to_numpy` returns the full value of a DTensor on every rank."""
    from torch.distributed.tensor import DTensor

    upstream_convert_to_numpy = core.convert_to_numpy

    def gather(x):
        return x.full_tensor() if isinstance(x, DTensor) else x

    def convert_to_numpy(x):
        if isinstance(x, (list, tuple)):
            x = type(x)(gather(e) for e in x)
        else:
            x = gather(x)
        return upstream_convert_to_numpy(x)

    core.convert_to_numpy = convert_to_numpy


def edit_compute_output_spec(core):
    """Shape inference replicates the placeholder tensors it creates.

    `compute_output_spec` first runs a function on meta tensors; where that
    fails it runs it on placeholder tensors of ones, which then meet the
    distributed variables. Under a distribution it runs in
    `replicate_created_tensors`, so the placeholders are replicated DTensors
    (they are identical on every process).
    """
    current_distribution = support.distribution_accessor()

    upstream_compute_output_spec = core.compute_output_spec

    def compute_output_spec(fn, *args, **kwargs):
        distribution = current_distribution()
        if distribution is None:
            return upstream_compute_output_spec(fn, *args, **kwargs)
        with support.torch_distribution_lib().replicate_created_tensors(
            distribution.device_mesh
        ):
            return upstream_compute_output_spec(fn, *args, **kwargs)

    core.compute_output_spec = compute_output_spec


def edit_variable_created_as_outside_builds(core):
    """A variable created in a layer's `build` computes its value as
    outside it: the torch function mode of `replicate_built_tensors` is
    off while a variable is created (its initial value is distributed by
    the variable edits, sharded variables shard by shard)."""
    from keras.src.backend.torch import created_tensors

    upstream_init = core.Variable.__init__

    @functools.wraps(upstream_init)
    def __init__(self, *args, **kwargs):
        with created_tensors.creating_variable():
            upstream_init(self, *args, **kwargs)

    core.Variable.__init__ = __init__


def edit_set_distribution_shares_seed(module):
    """`set_distribution` shares the seed and converts the mesh, in lockstep.

    Every process calls `set_distribution` in the same order, so the seed
    broadcast that a process group created outside `initialize` needs
    (`distribution_lib.share_seed_once`), and the creation of the mesh's
    process groups, happen there rather than at a first use that some
    processes may reach alone (a property, a log line).
    """
    if not support.is_torch_backend():
        return
    upstream_set_distribution = module.set_distribution

    def set_distribution(value):
        if value is not None:
            support.torch_distribution_lib().share_seed_once()
            value.device_mesh.backend_mesh
        upstream_set_distribution(value)

    module.set_distribution = set_distribution


# Upstream module name -> edits to apply once it has executed.
POST_IMPORT_EDITS = {
    "keras.src.backend.torch.core": lambda: [
        edit_variable_initialize,
        edit_variable_initialize_shard_by_shard,
        edit_variable_created_as_outside_builds,
        edit_variable_assign,
        edit_variable_repr,
        edit_convert_to_numpy,
        edit_compute_output_spec,
    ],
    "keras.src.backend": lambda: [edit_backend_distribution_lib],
    "keras.src.distribution.distribution_lib": lambda: [
        edit_distribution_api_binding,
        edit_tensor_layout_multi_axis,
        edit_set_distribution_shares_seed,
    ],
}
