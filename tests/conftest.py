"""Fixtures several test files share. Helper modules live in tests/helpers/ (`from helpers.launches import TINY`)."""

import os
import signal

import pytest
import torch

# The Triton backend's kernels run on CPU tensors only through Triton's interpreter, which triton 3.x chooses when it
# is first imported (its own library's @jit functions), when it decorates a kernel, and again at launch: so it is set
# before anything imports triton (transformers' model modules do), for the whole session and the ranks it spawns
# (tests/test_loss_triton.py). The torch backend, and `auto` on CPU, never import triton.
os.environ.setdefault("TRITON_INTERPRET", "1")


# A session started under `nohup` (or any parent that ignores SIGHUP) would pass SIG_IGN on to every process the
# tests start, and the trainer honours an inherited SIG_IGN (issue 72): the tests that hang up on a command would see
# it go on. They run as from a terminal; the test of `nohup` itself sets SIG_IGN in the process it starts.
signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.fixture(scope="session", autouse=True)
def away_from_the_checkout(tmp_path_factory):
    """Every test runs in an empty folder, not where pytest was started: a relative path on the command line
    (`train.output_dir=runs/x`) then never meets what the README's main job, or anything else, left there. (A
    recipe file's own relative paths are its folder's: tests give the shipped recipes a `train.output_dir` of
    their own, not the checkout's `runs/`.)"""
    started_in = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(started_in)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a second thread only waits on the first (a 100x slower first forward on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
