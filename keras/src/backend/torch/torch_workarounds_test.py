"""Tests of the workaround registry: each entry is needed exactly on the
torch versions it names, probed on the installed torch."""

import importlib.util

import torch

from keras.src import testing
from keras.src.backend.torch import sharding_rules
from keras.src.backend.torch import torch_probes
from keras.src.backend.torch import torch_workarounds


class WorkaroundRegistryTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        sharding_rules.register()

    def test_each_probed_entry_is_needed_where_it_says(self):
        for entry in torch_workarounds.WORKAROUNDS:
            if entry.probe is None:
                continue
            with self.subTest(entry.name):
                needed = getattr(torch_probes, entry.probe)()
                applies = entry.applies_to(torch.__version__)
                self.assertEqual(
                    needed,
                    applies,
                    f"'{entry.name}' ({entry.where}) is "
                    f"{'still' if needed else 'no longer'} needed on torch "
                    f"{torch.__version__}, whose versions it gives as "
                    f"{entry.versions}. Remove it {entry.remove_when}; "
                    "else correct its versions.",
                )

    def test_each_entry_is_complete(self):
        for entry in torch_workarounds.WORKAROUNDS:
            with self.subTest(entry.name):
                self.assertTrue(entry.problem and entry.issue)
                self.assertTrue(entry.remove_when)
                # A probe here, or where the gap is shown.
                self.assertTrue(entry.probe or entry.probed_by)
                first, last = entry.versions
                self.assertLessEqual(
                    torch_workarounds._minor(first),
                    torch_workarounds._minor(last),
                )
                module = "keras.src.backend.torch." + entry.where.split(".")[0]
                self.assertIsNotNone(importlib.util.find_spec(module))

    def test_every_rule_the_project_adds_or_wraps_has_an_entry(self):
        wheres = " ".join(e.where for e in torch_workarounds.WORKAROUNDS)
        names = {
            wrap.__name__ for _, wrap, _ in sharding_rules._wrapped_rules()
        }
        names.discard("backward_in_query_layout")  # attention_rules' entry
        names |= {"view_with_reshape_fallback", "_fallback_rules"}
        for name in names | {"attention_rules", "replicated_fallback"}:
            self.assertIn(name, wheres)
