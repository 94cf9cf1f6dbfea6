"""Tests of `local_call_state` (per-thread step state, cached plans)."""

import gc
import threading

import torch

from keras.src import layers
from keras.src import testing
from keras.src.backend.common import global_state
from keras.src.backend.torch import local_call_state


class LocalCallStateTest(testing.TestCase):
    def test_accumulating_steps_nest_and_restore(self):
        self.assertFalse(local_call_state.accumulating())
        with local_call_state.accumulating_into_variables():
            self.assertTrue(local_call_state.accumulating())
            with local_call_state.accumulating_into_variables():
                self.assertTrue(local_call_state.accumulating())
            self.assertTrue(local_call_state.accumulating())
        self.assertFalse(local_call_state.accumulating())
        with self.assertRaises(ValueError):
            with local_call_state.accumulating_into_variables():
                raise ValueError
        self.assertEqual(local_call_state.step_state().accumulating_steps, 0)

    def test_step_state_is_per_thread(self):
        seen = []

        def other_thread():
            state = local_call_state.step_state()
            seen.append(
                (
                    state.local_calls,
                    state.accumulating_steps,
                    state.effects,
                    dict(state.unsharded),
                    local_call_state.accumulating(),
                )
            )

        state = local_call_state.step_state()
        state.local_calls += 1
        try:
            with local_call_state.accumulating_into_variables():
                self.assertTrue(local_call_state.running_locally())
                thread = threading.Thread(target=other_thread)
                thread.start()
                thread.join()
        finally:
            state.local_calls -= 1
        self.assertEqual(seen, [(0, 0, 0, {}, False)])
        self.assertFalse(local_call_state.running_locally())

    def test_caches_are_per_process(self):
        caches = local_call_state.caches()
        seen = []
        thread = threading.Thread(
            target=lambda: seen.append(local_call_state.caches())
        )
        thread.start()
        thread.join()
        self.assertIs(seen[0], caches)
        global_state.clear_session(free_memory=False)
        self.assertIs(local_call_state.caches(), caches)

    def test_cache_entries_go_with_their_keys(self):
        caches = local_call_state.LocalCallCaches()
        layer = layers.Dense(2)
        caches.plans[layer] = {"signature": None}
        tensor = torch.ones(2)
        caches.computed[tensor] = (torch.zeros(2), 0)
        caches.gradient_specs[tensor] = {}
        self.assertIn(tensor, caches.computed)
        del layer, tensor
        gc.collect()
        self.assertEqual(len(caches.plans), 0)
        self.assertEqual(len(caches.computed), 0)
        self.assertEqual(len(caches.gradient_specs), 0)

    def test_weak_id_map(self):
        entries = local_call_state.WeakIdMap()
        first, second = torch.ones(2), torch.ones(2)
        entries[first] = "first"
        self.assertEqual(entries.get(first), "first")
        self.assertEqual(entries[first], "first")
        self.assertIn(first, entries)
        # Keyed by identity, not by value.
        self.assertNotIn(second, entries)
        self.assertIsNone(entries.get(second))
        with self.assertRaises(KeyError):
            entries[second]
        entries[first] = "again"
        entries[second] = "second"
        self.assertEqual(len(entries), 2)
        self.assertEqual(entries.get(first), "again")
        del first
        gc.collect()
        self.assertEqual(len(entries), 1)
        self.assertEqual(entries.get(second), "second")
