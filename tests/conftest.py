"""Shared test helpers. tests/ is put on sys.path so that spawned engine
processes can import the fake core in tests/server_fakes.py."""

from __future__ import annotations

import os
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
