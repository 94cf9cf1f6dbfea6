"""Names re-exported from `keras_dtensor`, resolved on first access."""

import importlib

# Public name -> in-tree module that defines it.
PUBLIC_NAMES = {
    # Layout helpers.
    "column_parallel": "keras.src.distribution.tensor_parallel",
    "row_parallel": "keras.src.distribution.tensor_parallel",
    "prepare_input": "keras.src.distribution.tensor_parallel",
    "prepare_output": "keras.src.distribution.tensor_parallel",
    "tensor_parallel_layouts": "keras.src.distribution.tensor_parallel",
    "fully_sharded_layouts": "keras.src.distribution.fully_sharded",
    "auto_tensor_parallel_plan": "keras.src.distribution.automatic_plans",
    "auto_tensor_parallel_layouts": "keras.src.distribution.automatic_plans",
    "expert_parallel": "keras.src.distribution.automatic_plans",
    "merge_layouts": "keras.src.distribution.layout_composition",
    "check_layouts": "keras.src.distribution.layout_composition",
    "make_device_mesh": "keras.src.distribution.layout_composition",
    "layout_map_axes": "keras.src.distribution.layout_composition",
    # Activation recomputation.
    "remat_layers": "keras.src.distribution.remat",
    # Sharded checkpoints.
    "save_checkpoint": "keras.src.backend.torch.distributed_checkpoint",
    "load_checkpoint": "keras.src.backend.torch.distributed_checkpoint",
    "checkpoint_variables": "keras.src.backend.torch.distributed_checkpoint",
}


def resolve(name):
    """Imports and returns the public object `name`."""
    module = importlib.import_module(PUBLIC_NAMES[name])
    return getattr(module, name)
