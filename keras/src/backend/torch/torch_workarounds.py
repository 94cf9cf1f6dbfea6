"""The registry of the project's workarounds of torch gaps.

Contract: `WORKAROUNDS` lists every DTensor rule, wrapped rule and
fallback the project adds (and the other torch gaps it works around):
what is wrong in torch, the torch versions that need the workaround, the
torch issue, and when it can go. An entry with a `probe` says, on the
installed torch, whether the gap is still there (the probes call torch's
own rules, as `sharding_rules.TORCH_RULES` recorded them before the
project changed any); `torch_workarounds_test` fails where an entry is
no longer needed on a torch it names, or needed on one it does not. An
entry without a probe names the test or script that shows the gap.

Versions are ranges of torch minor releases, both ends included, found
by the probes on the releases the torch matrix runs (2.11 and 2.13).
"""

import dataclasses

# The newest torch the probes ran on: a gap still open there is listed up
# to it, and a newer torch that still has it fails the test until the
# entry says so.
NEWEST = "2.13"


@dataclasses.dataclass(frozen=True)
class Workaround:
    """One torch gap and the project's answer to it.

    Attributes:
        name: a short name.
        where: the module that holds the workaround.
        problem: what is wrong in torch.
        versions: `(first, last)` torch minor releases that need it.
        issue: the torch issue or pull request, or why none is cited.
        remove_when: when the workaround can go.
        probe: the name of a function of `torch_probes` that says
            whether the installed torch still has the gap, or None.
        probed_by: where the gap is shown when there is no probe.
    """

    name: str
    where: str
    problem: str
    versions: tuple
    issue: str
    remove_when: str
    probe: str = None
    probed_by: str = None

    def applies_to(self, version):
        """Whether torch `version` ("2.13.0+cpu") needs the workaround."""
        minor = _minor(version)
        return _minor(self.versions[0]) <= minor <= _minor(self.versions[1])


def _minor(version):
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


PR = "https://github.com/pytorch/pytorch/pull/"
ISSUE = "https://github.com/pytorch/pytorch/issues/"
UNTIL_FIXED = "once the torch range starts at a release that has the rule"

WORKAROUNDS = (
    Workaround(
        "cpu flash attention rule",
        "attention_rules",
        "DTensor has no rule for the CPU flash-attention kernel (forward "
        "and backward) that scaled_dot_product_attention uses on CPU.",
        ("2.11", NEWEST),
        "none filed (CUDA kernels: " + ISSUE + "120333)",
        UNTIL_FIXED,
        probe="cpu_flash_attention_has_no_rule",
    ),
    Workaround(
        "cuda attention mask placement",
        "attention_rules",
        "The cuDNN forward rule lists no placement for a split mask, and "
        "the cuDNN and efficient rules split a mask that broadcasts over "
        "heads ([B, 1, T, T]) along its size-1 head dimension.",
        ("2.13", NEWEST),
        "none filed (the rules: " + PR + "148377, " + PR + "122996)",
        "once torch's rules place a mask like the queries",
        probe="cudnn_forward_rule_drops_the_mask",
    ),
    Workaround(
        "view flattens a sharded inner dimension",
        "view_rules.view_with_reshape_fallback",
        "The view rule refuses to merge a sharded dimension into the one "
        "before it ('Attempted to flatten multiple dimensions').",
        ("2.11", "2.11"),
        PR + "166483 (view with _StridedShard, torch 2.12)",
        "once the torch range starts at 2.12",
        probe="view_refuses_to_flatten_a_sharded_inner_dimension",
    ),
    Workaround(
        "view of a dimension sharded on a mesh axis of size 1",
        "view_rules.view_with_reshape_fallback",
        "The view rule refuses to reshape a dimension sharded over a mesh "
        "axis of one process, which holds the whole dimension.",
        ("2.11", NEWEST),
        "none filed (the refusal: " + PR + "149764)",
        "once the view rule lets a size-1 axis' shard through",
        probe="view_refuses_a_shard_on_an_axis_of_one_process",
    ),
    Workaround(
        "view of an uneven split",
        "view_rules.view_with_reshape_fallback",
        "The view rule refuses to flatten or unflatten an unevenly split "
        "dimension (a last batch that does not divide by the processes).",
        ("2.11", NEWEST),
        ISSUE + "143372",
        "once that issue is fixed in the torch range's first release",
        probe="view_refuses_an_uneven_split",
    ),
    Workaround(
        "uneven split behind an axis of one process",
        "view_rules.view_with_reshape_fallback",
        "The view rules check a split dimension against the first mesh "
        "axis that splits it only: (Shard(0), Shard(0)) on a (1, 2) mesh "
        "with 3 rows is viewed as if split evenly.",
        ("2.11", NEWEST),
        "none filed (nearest: " + PR + "177973)",
        "once the view rules check every axis that splits a dimension",
        probe="view_accepts_an_uneven_split_behind_an_axis_of_one",
    ),
    Workaround(
        "unbind along a sharded dimension",
        "view_rules.unbind_with_gather_fallback",
        "The unbind rule refuses to unbind the dimension it is split on "
        "(Keras's RNN loop iterates over the batch).",
        ("2.11", NEWEST),
        PR + "162560 (refused on purpose: unbind returns views)",
        "once the unbind rule gathers the dimension itself",
        probe="unbind_refuses_a_sharded_dimension",
    ),
    Workaround(
        "stack with a negative dimension",
        "sharding_rules.stack_with_dim_normalized",
        "The stack rule counts a negative dimension in the inputs' rank, "
        "one less than the output's.",
        ("2.11", "2.11"),
        PR + "174640",
        "once the torch range starts at 2.12",
        probe="stack_misplaces_a_negative_dimension",
    ),
    Workaround(
        "transpose of a _StridedShard",
        "sharding_rules.transpose_moves_strided_shards",
        "The t rule moves each Shard to the other dimension but leaves a "
        "_StridedShard where it was.",
        ("2.11", "2.11"),
        "none found (torch 2.12 moves it)",
        "once the torch range starts at 2.12",
        probe="transpose_leaves_a_strided_shard",
    ),
    Workaround(
        "pooling backward rules",
        "sharding_rules._fallback_rules",
        "No rule for the backward of average pooling (2-D, 3-D), max "
        "pooling (3-D) and adaptive pooling (torch 2.11: no pooling rule "
        "at all).",
        ("2.11", NEWEST),
        PR + "182526 (open)",
        UNTIL_FIXED,
        probe="pooling_backward_has_no_rule",
    ),
    Workaround(
        "replicate and reflect padding rules",
        "sharding_rules._fallback_rules",
        "No rule for replication and reflection padding, forward or backward.",
        ("2.11", NEWEST),
        PR + "166482 (not in torch 2.13)",
        UNTIL_FIXED,
        probe="padding_has_no_rule",
    ),
    Workaround(
        "fill with a tensor value",
        "sharding_rules._fill_sharding",
        "No rule for fill with a tensor value (Keras's image transforms).",
        ("2.11", NEWEST),
        "none found",
        UNTIL_FIXED,
        probe="fill_with_a_tensor_has_no_rule",
    ),
    Workaround(
        "squeeze of several dimensions",
        "sharding_rules._squeeze_dims_sharding",
        "No rule for squeeze.dims (ops.squeeze with a tuple of axes).",
        ("2.11", "2.11"),
        PR + "173563",
        "once the torch range starts at 2.12",
        probe="squeeze_dims_has_no_rule",
    ),
    Workaround(
        "complex",
        "sharding_rules._complex_sharding",
        "No rule for complex (ops.istft).",
        ("2.11", NEWEST),
        "none found",
        UNTIL_FIXED,
        probe="complex_has_no_rule",
    ),
    Workaround(
        "ops without a rule run replicated in steps",
        "replicated_fallback",
        "No rule at all for ops Keras steps run (scatter_reduce, which "
        "segment reductions and AUC use; searchsorted).",
        ("2.11", NEWEST),
        PR + "177414 (not in torch 2.13)",
        "never as a mechanism; the ops it names once torch has rules",
        probe="scatter_reduce_has_no_rule",
    ),
    Workaround(
        "a rule blind to the mesh runs replicated in steps",
        "replicated_fallback",
        "constant_pad_nd's rule gives one placement on any mesh.",
        ("2.11", "2.11"),
        PR + "175656",
        "once the torch range starts at 2.12",
        probe="constant_pad_rule_is_blind_to_the_mesh",
    ),
    Workaround(
        "_StridedShard sizes under compile",
        "strided_shard_sizes",
        "_StridedShard computes a shard's size with torch.arange, which "
        "compile's tracing modes catch.",
        ("2.13", NEWEST),
        PR + "184945 (the offsets only)",
        "once torch computes the size without tensors",
        probed_by="integration_tests/jit_compile_test.py (keras-hub Gemma)",
    ),
    Workaround(
        "cat of size-1 dimensions in the recorded layout",
        "local_layouts",
        "A local cat result is channels_last where DTensor records it "
        "contiguous (size-1 dimensions' free strides).",
        ("2.11", NEWEST),
        "not reported upstream yet",
        "once DTensor lays local cat results out as it records them",
        probed_by="integration_tests/step_handlers_test.py (the gap "
        "outside a step)",
    ),
    Workaround(
        "cross-entropy of class-split logits",
        "split_class_losses",
        "log_softmax of a tensor split along its softmax dimension gathers "
        "it whole (the step's logits, split along the vocabulary); "
        "torch's loss_parallel avoids it, but process-wide, and its "
        "log_softmax backward assumes an nll_loss follows.",
        ("2.11", NEWEST),
        "no torch issue found; loss_parallel is torch's opt-in answer",
        "once DTensor reduces log_softmax along a split dimension without "
        "gathering it",
        probed_by="integration_tests/step_handlers_test.py (the gather "
        "outside a step)",
    ),
    Workaround(
        "all-gather along a negative dimension",
        "extreme_reductions",
        "The functional all-gather views its result with a wrong shape "
        "for a negative gather dimension (_maybe_view_chunk_cat).",
        ("2.11", NEWEST),
        ISSUE + "194856 (fixed by " + PR + "194865)",
        "once the torch range starts at a release with the fix",
        probe="chunk_cat_misreads_a_negative_dimension",
    ),
    Workaround(
        "collectives over mesh axes of one process",
        "unit_axis_redistribution",
        "A redistribution plans mesh axes of one process with the others "
        "(Python time for no communication), and warns of two sequential "
        "all-reduces for a value partial over one of them and another.",
        ("2.11", NEWEST),
        "not reported upstream yet",
        "once DTensor plans no collective over a mesh axis of one process",
        probed_by="keras/src/backend/torch/unit_axis_redistribution_test.py",
    ),
    Workaround(
        "redistribution between partial types",
        "unit_axis_redistribution",
        "A value partial with one reduce op cannot be redistributed to a "
        "partial value of another (P(avg) to P(sum): keras-hub's MoE "
        "auxiliary loss summed with the training loss under "
        "DataParallel).",
        ("2.11", NEWEST),
        "not reported upstream yet",
        "once DTensor moves between partial types",
        probed_by="integration_tests/step_handlers_test.py (the refusal "
        "outside a step)",
    ),
    Workaround(
        "einsum with a replicated operand beside a split one",
        "argument_layouts",
        "DTensor's einsum views its operands for a batched matmul, where a "
        "split of the heads becomes a strided split, and gathers the "
        "split operand rather than chunking the replicated one (queries "
        "beside keras-hub's replicated KV cache; Llama's output "
        "projection, its kernel split along the contracted heads, beside "
        "a replicated input).",
        ("2.11", NEWEST),
        "not reported upstream yet",
        "once DTensor's einsum chunks a replicated operand along a letter "
        "of both operands",
        probed_by="integration_tests/step_handlers_test.py (the gather "
        "outside a step)",
    ),
    Workaround(
        "gloo worker threads race on the group's status",
        "gloo_groups",
        "ProcessGroupGloo's worker threads assign the group's status "
        "string outside its lock: a double free, heap corruption.",
        ("2.13", NEWEST),
        "not reported upstream yet",
        "once runLoop writes the status under the group's lock",
        probed_by="scripts/torch_gloo_status_race.py",
    ),
    Workaround(
        "gloo threads at interpreter exit",
        "process_group.destroy_process_group",
        "Process groups are left to interpreter finalization, and gloo's "
        "threads outlive destroy_process_group: an abort at exit.",
        ("2.11", NEWEST),
        ISSUE + "190489 (open); " + PR + "179291 (abandoned)",
        "once torch tears groups down at exit and stops gloo's threads",
        probed_by="integration_tests/clean_exit_test.py",
    ),
    Workaround(
        "masked lookups: the mask in the placement",
        "sharded_lookups",
        "A lookup into a row-split embedding keeps its mask in a "
        "_MaskPartial placement until the first reduction: a second "
        "reduction fails, and under torch.compile the traced reduction "
        "finds no mask (AssertionError in _MaskPartial._reduce_value).",
        ("2.11", NEWEST),
        ISSUE + "160697 (open); " + PR + "185356",
        "once the torch range starts at a release whose compiled lookups "
        "keep their mask and whose masked values reduce more than once",
        probed_by="integration_tests/jit_compile_test.py (the transformer "
        "with a vocabulary-split embedding)",
    ),
    Workaround(
        "compiled steps: missing tangents and aliased outputs",
        "compiled_graph_outputs",
        "AOT autograd drops tangents of DTensor outputs and refuses "
        "aliased outputs of a graph split inside a layer.",
        ("2.11", NEWEST),
        ISSUE + "172556; " + ISSUE + "184002 (open)",
        "once AOT autograd handles both",
        probed_by="integration_tests/jit_compile_test.py",
    ),
)
