#!/usr/bin/env python3
"""Unit test of tools/gguf_to_safetensors.py's q/k row permutation (needs numpy; exits 77,
"skipped", without it)."""
import os
import sys
import unittest

try:
    import numpy as np
except ImportError:
    print("numpy not installed: skipped (scripts/fetch-smollm2.sh makes .cache/venv-gguf)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_to_safetensors as conv  # noqa: E402


class PermutationTest(unittest.TestCase):
    def test_hand_checked_rows(self):
        # One head of d = 4: Hugging Face rows r0 r1 | r2 r3 rotate pairs (r0, r2), (r1, r3);
        # llama.cpp stores them adjacent: r0 r2 r1 r3.
        hf = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
        gg = conv.hf_rows_to_gguf(hf, 1)
        np.testing.assert_array_equal(gg, hf[[0, 2, 1, 3]])
        np.testing.assert_array_equal(conv.gguf_rows_to_hf(gg, 1), hf)

    def test_per_head_and_inverse(self):
        # Two heads of d = 6: the permutation stays inside each head.
        hf = np.random.default_rng(0).standard_normal((12, 5)).astype(np.float32)
        gg = conv.hf_rows_to_gguf(hf, 2)
        np.testing.assert_array_equal(gg[:6], hf[[0, 3, 1, 4, 2, 5]])
        np.testing.assert_array_equal(gg[6:], hf[[6, 9, 7, 10, 8, 11]])
        np.testing.assert_array_equal(conv.gguf_rows_to_hf(gg, 2), hf)
        self.assertFalse(np.array_equal(conv.gguf_rows_to_hf(gg, 1), hf))  # heads matter

    def test_byte_decoder_covers_every_byte(self):
        dec = conv.byte_decoder()
        self.assertEqual(sorted(dec.values()), list(range(256)))
        self.assertEqual(dec["\u0120"], 0x20)  # "Ġ" is the space
        self.assertEqual(dec["\u010a"], 0x0A)  # "Ċ" is the newline


if __name__ == "__main__":
    unittest.main()
