"""The private parts of torch's runtime the project uses: one door.

Contract: with `torch_internals` (DTensor's), the only module that names
private torch APIs: the autograd engine, the torch function mode stack,
`torch.distributed`'s registry and gloo options, the compiler's caches
and backends, and torch's pytree (`torch_internals_test` checks the
sources). A torch upgrade that moves one of them is met here.
"""

import torch
import torch.distributed as dist
from torch.utils import _python_dispatch
from torch.utils import _pytree

# Torch's pytree, which knows torch's containers (and `torch.Size`).
pytree = _pytree
# The autograd node that accumulates a leaf's gradient.
ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad
# Inside, torch dispatch and function modes are off (a context).
disable_current_modes = _python_dispatch._disable_current_modes


def version(tensor):
    """The in-place write counter of `tensor`: it changes at each write."""
    return tensor._version


def engine_will_execute(node):
    """Whether the running backward pass executes `node`; raises
    RuntimeError where no backward pass runs, or it is
    `torch.autograd.grad`'s."""
    return torch._C._will_engine_execute_node(node)


def queue_engine_callback(callback):
    """Queues `callback` to run when the running backward pass ends;
    raises RuntimeError where none runs."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def post_accumulate_grad_hooks(parameter):
    """The hooks `register_post_accumulate_grad_hook` gave `parameter`,
    by handle id, or None."""
    return parameter._post_accumulate_grad_hooks


def saved_tensors_hooked():
    """Whether autograd's saved tensors pass through default hooks."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None


def current_function_mode():
    """The innermost torch function mode, or None."""
    return torch.overrides._get_current_function_mode()


def function_mode_popped():
    """Inside, the innermost torch function mode is off the stack."""
    return torch.overrides._pop_mode_temporarily()


def pop_function_mode():
    """Takes the innermost torch function mode off the stack; returns it."""
    return torch._C._pop_torch_function_stack()


def push_function_mode(mode):
    """Puts `mode` back on the torch function mode stack."""
    torch._C._push_on_torch_function_stack(mode)


def default_store():
    """The store of `torch.distributed`'s default process group."""
    return dist.distributed_c10d._get_default_store()


def process_group_names():
    """`(group, name, ranks by global rank)` of each process group
    `torch.distributed` knows."""
    world = dist.distributed_c10d._world
    return [
        (group, name, world.pg_group_ranks.get(group, {}))
        for group, name in world.pg_names.items()
    ]


def sequence_number(group):
    """How many collectives `group` has issued."""
    return group._get_sequence_number_for_group()


def gloo_options(gloo_class, devices, threads, timeout):
    """Options of a gloo process group with these devices, worker
    threads and timeout."""
    options = gloo_class._Options()
    options._devices = devices
    options._threads = threads
    options._timeout = timeout
    return options


def gloo_worker_threads(group):
    """The worker threads of `group`'s gloo backend."""
    return group._get_backend(torch.device("cpu")).options._threads


def c10d_functional_ops():
    """The functional collectives' ops (`all_reduce`, `wait_tensor`...)."""
    return torch.ops._c10d_functional


def all_reduce_sum(tensor, mesh, mesh_dim):
    """The sum of `tensor` over one mesh axis, waited for.

    The functional all-reduce that DTensor issues, called directly rather
    than by `funcol.all_reduce`, whose wrapping is a custom operator for
    autograd's sake: the caller is an autograd function's forward.
    """
    functional = c10d_functional_ops()
    group_name = mesh.get_group(mesh_dim).group_name
    # Waited for where it is issued, before backward starts, as DTensor
    # waits for its own. Leaving a mean's all-reduce pending while
    # backward ran (and reading the loss only after the optimizer) was
    # measured slower: 0.4 to 2.6 ms a step for the benchmark's
    # transformer and llama on 2 and 4 gloo processes of a 2-core
    # machine, 100 to 150 alternating steps.
    return functional.wait_tensor(
        functional.all_reduce(tensor, "sum", group_name)
    )


def inductor_config():
    """Inductor's configuration module."""
    from torch._inductor import config

    return config


def custom_graph_pass_class():
    """Inductor's base class of custom graph passes (those with a cache
    key)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def compile_fx_module():
    """Inductor's `compile_fx` module."""
    from torch._inductor import compile_fx

    return compile_fx


def autograd_cache_disabled():
    """Inside, AOTAutograd's cache is off."""
    return torch._functorch.config.patch(enable_autograd_cache=False)


def fake_mode_of(tensor):
    """The fake tensor mode `tensor` belongs to, or None (a context)."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    return maybe_get_fake_mode(tensor)


def compiler_backend(name):
    """The `torch.compile` backend registered as `name`."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def chunk_cat(rows, chunks, dim):
    """Torch's `_maybe_view_chunk_cat`: `rows` split in `chunks` along
    dimension 0, joined along `dim` (what DTensor's all-gather does)."""
    from torch._utils import _maybe_view_chunk_cat

    return _maybe_view_chunk_cat(rows, chunks, dim)
