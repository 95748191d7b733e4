"""The soak's RSS split: the Celery worker's own memory apart from its model process's, so a
growing child is not read as a leak in the worker (bench/soak.py)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import psutil

from bench.soak import rss_mb

PARENT = ("import subprocess, sys, time; "
          "c = subprocess.Popen([sys.executable, '-c', "
          "'x = bytearray(80_000_000); print(1, flush=True); import time; time.sleep(60)'], "
          "stdout=sys.stdout); time.sleep(60)")


def test_rss_splits_the_process_from_its_children():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"1"   # the child holds its 80 MB now
        group = SimpleNamespace(proc=proc)
        root, children = rss_mb(group, "root"), rss_mb(group, "children")
        assert children >= 76               # the child's bytearray, touched
        assert root < children              # the parent holds none of it
        total = rss_mb(group)
        assert abs(total - (root + children)) < 5   # "all" is both (sampled moments apart)
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()
