"""One cell of the benchmark table: a workload in a mode, Keras vs native.

A cell builds the Keras model under the mode's `keras.distribution`, its
native PyTorch twin with the same initial weights and PyTorch's own
parallelism, checks that both compute the same global losses over several
training steps (so that the gradients and the optimizer agree too), then
measures collectives per step, per-rank memory, and interleaved step
times. Both steps return the global loss, all-reduced over the
data-parallel processes.
"""

import contextlib
import gc
import math

import keras_models
import measure
import torch
import torch.distributed as dist
import torch_models
import workloads

import keras

# Modes where each process trains on its own slice of the global batch.
BATCH_SHARDED = ("dp", "2d", "fsdp")

# Optimizer state tensors per parameter.
SLOTS = {"sgd": 1, "adamw": 2}

# The twin check: training steps compared, and the largest relative
# difference of their global losses for the two sides to count as the same
# model trained the same way.
TWIN_STEPS = 3
TWIN_RTOL = 1e-4


def device():
    """This process's device: its CUDA device if there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def error_text(error):
    """A one-line description of an exception for the table."""
    lines = (line.strip() for line in str(error).splitlines())
    text = " ".join(line for line in lines if line)
    return f"{type(error).__name__}: {text[:220]}"


def batch_slice(mode, mesh, tensor):
    """This process's part of a global batch under native parallelism."""
    if mode not in BATCH_SHARDED:
        return tensor
    if mode == "2d":
        parts, index = mesh.size(0), mesh.get_local_rank("batch")
    else:
        parts, index = dist.get_world_size(), dist.get_rank()
    return tensor.chunk(parts, dim=0)[index]


def loss_group(mode, mesh):
    """The process group whose losses make up the global batch's, or None.

    Under data parallelism each process computes the loss of its slice;
    the global loss, which Keras logs, is their mean over this group.
    """
    if mode not in BATCH_SHARDED or not dist.is_initialized():
        return None
    if dist.get_world_size() == 1:
        return None
    if mode == "2d":
        return mesh["batch"].get_group()
    return dist.group.WORLD


def twin_check(keras_step, native_step, steps):
    """Trains both sides `steps` steps; compares their global losses.

    Returns:
        A dict with both loss lists, the largest relative difference
        `max_rel_diff` and `ok` (whether it is within `TWIN_RTOL`).
    """
    keras_losses = [keras_step() for _ in range(steps)]
    native_losses = [native_step() for _ in range(steps)]
    difference = max(
        abs(k - n) / max(abs(n), 1e-12)
        for k, n in zip(keras_losses, native_losses)
    )
    return {
        "steps": steps,
        "keras": keras_losses,
        "native": native_losses,
        "max_rel_diff": difference,
        "rtol": TWIN_RTOL,
        "ok": bool(difference <= TWIN_RTOL),
    }


class KerasRunner:
    """A compiled Keras model and its training step on one global batch."""

    def __init__(self, workload, config, distribution, x, y, jit=False):
        self.distribution = distribution
        self.x, self.y = x, y
        with self.scope():
            self.model = keras_models.build_model(
                workload, config, jit_compile=jit
            )

    def scope(self):
        """The distribution scope (a no-op without a distribution)."""
        if self.distribution is None:
            return contextlib.nullcontext()
        return self.distribution.scope()

    def step(self):
        """One `train_on_batch`; returns the (global) loss."""
        with self.scope():
            return float(self.model.train_on_batch(self.x, self.y))

    def full_sizes(self):
        """`{path: bytes}` of every trainable variable's full value."""
        return {
            v.path: math.prod(v.shape) * v.value.element_size()
            for v in self.model.trainable_variables
        }

    def memory(self, limit):
        """Per-rank bytes of parameters, gradients and optimizer state."""
        parameters = [v.value for v in self.model.trainable_variables]
        return measure.memory_report(
            parameters,
            [p.grad for p in parameters],
            [v.value for v in self.model.optimizer.variables],
            limit,
        )


class NativeRunner:
    """The native twin of a Keras model under PyTorch's own parallelism."""

    def __init__(self, workload, config, mode, mesh, keras_model, x, y):
        model = torch_models.build_model(workload, config).to(device())
        torch_models.copy_keras_weights(keras_model, model)
        self.model = torch_models.parallelize(model, mode, mesh)
        self.optimizer = torch_models.make_optimizer(
            config, self.model.parameters()
        )
        self.x = batch_slice(mode, mesh, x)
        self.y = batch_slice(mode, mesh, y)
        self.loss_group = loss_group(mode, mesh)

    def step(self):
        """One training step; returns the global loss, as Keras does."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch_models.loss_fn(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        loss = loss.detach()
        if self.loss_group is not None:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.loss_group)
            loss = loss / dist.get_world_size(self.loss_group)
        return loss.item()

    def memory(self, limit):
        """Per-rank bytes of parameters, gradients, optimizer state and
        DDP's gradient buckets."""
        parameters = [
            p for group in self.optimizer.param_groups for p in group["params"]
        ]
        return measure.memory_report(
            parameters,
            [p.grad for p in parameters],
            torch_models.optimizer_state(self.optimizer),
            limit,
            buffers=torch_models.ddp_bucket_bytes(self.model),
        )


def _mesh(distribution):
    if distribution is None:
        return None
    return distribution.device_mesh.backend_mesh


def _warm_up(runner, count):
    for _ in range(count):
        runner.step()


def run_cell(workload, mode, config, options):
    """Measures one workload in one mode; never raises.

    Args:
        workload: one of `workloads.WORKLOADS`.
        mode: one of `workloads.MODES`.
        config: a `workloads.Config`.
        options: dict with `steps`, `warmup`, `jit` (bool) and `seed`.

    Returns:
        A JSON-able dict. Parts that failed hold an `error` string instead
        of numbers.
    """
    cell = new_cell(workload, mode)
    try:
        steps = prepare(cell, config, options)
        finish(cell, measure.time_steps(steps, options["steps"]))
    except Exception as error:  # noqa: BLE001 - reported in the table
        cell["error"] = error_text(error)
    gc.collect()
    return cell


def new_cell(workload, mode):
    """An empty result for `workload` in `mode`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"workload": workload, "mode": mode, "world": world}


def prepare(cell, config, options):
    """Everything but the timing: build, check, count, measure memory.

    Fills `cell` with the twin check (the global losses of both models
    over `options["twin_steps"]` steps, default `TWIN_STEPS`), the
    collectives of one step and the per-rank memory against the mode's
    limit, after `options["warmup"]` more steps.

    Returns:
        A dict mapping `keras`, `native` (and `keras_jit` with
        `options["jit"]`, if it compiles) to a zero-argument training step.
    """
    workload, mode, world = cell["workload"], cell["mode"], cell["world"]
    keras.utils.set_random_seed(options["seed"])
    torch.manual_seed(options["seed"])
    distribution = keras_models.make_distribution(mode, world, workload)
    x_np, y_np = workloads.make_batch(workload, config, options["seed"])
    x = torch.as_tensor(x_np, device=device())
    y = torch.as_tensor(y_np, device=device())
    slots = SLOTS[config.optimizer]

    keras_runner = KerasRunner(workload, config, distribution, x, y)
    native = NativeRunner(
        workload, config, mode, _mesh(distribution), keras_runner.model, x, y
    )
    twin = twin_check(
        keras_runner.step,
        native.step,
        options.get("twin_steps", TWIN_STEPS),
    )
    cell["twin"] = twin
    cell["first_loss"] = {
        "keras": twin["keras"][0],
        "native": twin["native"][0],
    }
    cell["loss_rel_diff"] = twin["max_rel_diff"]
    _warm_up(keras_runner, options["warmup"])
    _warm_up(native, options["warmup"])

    cell["collectives"] = {
        "keras": measure.count_collectives(keras_runner.step),
        "native": measure.count_collectives(native.step),
    }
    cell["python_calls"] = {
        "keras": measure.python_calls(keras_runner.step),
        "native": measure.python_calls(native.step),
    }
    grad_bytes = measure.layout_limit_bytes(
        [v.value for v in keras_runner.model.trainable_variables]
    )
    cell["collectives"]["minimum"] = workloads.minimum_collectives(
        workload, config, mode, grad_bytes, world
    )
    limit = workloads.memory_limit_bytes(
        mode, world, keras_runner.full_sizes(), slots
    )
    cell["memory"] = {
        "keras": keras_runner.memory(limit),
        "native": native.memory(limit),
    }

    steps = {"keras": keras_runner.step, "native": native.step}
    if options["jit"]:
        jit = _jit_runner(cell, workload, config, distribution, x, y, options)
        if jit is not None:
            steps["keras_jit"] = jit.step
    return steps


def finish(cell, times):
    """Adds median step times and ratios to `cell`.

    Args:
        cell: the result being filled.
        times: dict mapping a step name to its step times in seconds.
    """
    cell["step_ms"] = {name: measure.median_ms(t) for name, t in times.items()}
    cell["step_ms_all"] = {
        name: [1000.0 * v for v in t] for name, t in times.items()
    }
    cell["ratio"] = cell["step_ms"]["keras"] / cell["step_ms"]["native"]
    if "keras_jit" in cell["step_ms"]:
        cell["jit_speedup"] = (
            cell["step_ms"]["keras"] / cell["step_ms"]["keras_jit"]
        )
    _check_finite(cell)


def _jit_runner(cell, workload, config, distribution, x, y, options):
    """Builds and warms up the `jit_compile=True` model, or records why not.

    The first step, which compiles, is timed (the slowest process's) into
    `cell["jit_compile_s"]`. Every process must fail alike for the run to
    go on, which holds for compile errors since they do not depend on the
    rank.
    """
    keras.utils.set_random_seed(options["seed"])
    try:
        runner = KerasRunner(workload, config, distribution, x, y, jit=True)
        first = measure.time_steps({"first": runner.step}, 1)["first"]
        cell["jit_compile_s"] = first[0]
        _warm_up(runner, max(2, options["warmup"]))
    except Exception as error:  # noqa: BLE001 - reported in the table
        cell["jit_error"] = error_text(error)
        return None
    return runner


def _check_finite(cell):
    for name, value in cell["step_ms"].items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"Non-positive step time for {name}: {value}")
