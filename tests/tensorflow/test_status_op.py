"""The graph op behind Horovod's error types inside graphs, in one process.

Multi-rank: tests/multiproc/workers/tf_horovod_compat.py, case graph_errors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import dp_plugin.tensorflow as dp
from dp_plugin.tensorflow import status_op


def test_the_op_fails_with_the_code_and_the_message_unchanged() -> None:
    message = "Mismatched allreduce tensor shapes: rank(s) 0 passed (2,)\nsecond line 'quoted'"

    @tf.function
    def fail(code: tf.Tensor) -> tf.Tensor:
        with tf.control_dependencies([status_op.fail_on(code, tf.constant(message))]):
            return tf.constant(1)

    assert int(fail(tf.constant(0))) == 1
    with pytest.raises(tf.errors.FailedPreconditionError) as caught:
        fail(tf.constant(tf.errors.FAILED_PRECONDITION))
    assert message in caught.value.message


def test_a_bad_argument_is_invalid_argument_in_a_graph_with_the_eager_message() -> None:
    with pytest.raises(tf.errors.InvalidArgumentError) as eager:
        dp.alltoall(tf.ones([3]), [1, 1])
    assert isinstance(eager.value, ValueError)
    with pytest.raises(tf.errors.InvalidArgumentError) as graph:
        tf.function(lambda: dp.alltoall(tf.ones([3]), [1, 1]))()
    assert str(eager.value) in graph.value.message


def test_the_library_loads_once_per_process_and_keeps_its_op(tmp_path: Path) -> None:
    # The library is loaded through its open file (/proc/self/fd/N). Loaded
    # again under another N, TensorFlow sees a new file whose ops are already
    # registered and returns a module without them (seen when a test cleared
    # the cache while another file was open, and a later graph collective
    # failed with "no attribute 'dp_plugin_status'").
    first = status_op.library()
    assert first is not None and hasattr(first, "dp_plugin_status")
    status_op.library.cache_clear()
    with open(tmp_path / "holds-the-next-fd", "w"):  # the next load gets another N
        again = status_op.library()
    assert again is first and hasattr(again, "dp_plugin_status")


def test_without_a_compiler_it_warns_and_graphs_keep_tensorflows_types(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    status_op.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not build its TensorFlow status op"):
            assert status_op.library() is None
        out = tf.function(lambda: dp.allreduce(tf.ones([2]), op=dp.Sum))()
        np.testing.assert_allclose(out, [1.0, 1.0])
        with pytest.raises(tf.errors.InvalidArgumentError, match="splits"):
            tf.function(lambda: dp.alltoall(tf.ones([3]), [1, 1]))()
    finally:
        status_op.library.cache_clear()


PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(getenv("DP_PLUGIN_TEST_PLANTED"), "w");
    if (marker) fclose(marker);
}
"""


def _plant(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A library at the cache's predictable name whose loading creates a marker file."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted library")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    marker = tmp_path / "planted-library-ran"
    monkeypatch.setenv("DP_PLUGIN_TEST_PLANTED", str(marker))
    target = status_op._target()
    target.parent.mkdir(parents=True)
    (tmp_path / "planted.c").write_text(PLANTED)
    subprocess.run([compiler, "-shared", "-fPIC", str(tmp_path / "planted.c"), "-o", str(target)],
                   check=True)
    return target, marker


def _refused(marker: Path, match: str) -> None:
    status_op.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=match):
            assert status_op.library() is None
        assert not marker.exists(), "the planted library was loaded"
        out = tf.function(lambda: dp.allreduce(tf.ones([2]), op=dp.Sum))()
        np.testing.assert_allclose(out, [1.0, 1.0])
    finally:
        status_op.library.cache_clear()


def test_a_library_planted_in_a_world_writable_cache_is_not_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cache name is a hash of public inputs: in a shared or world-writable cache
    another user could put a library there that every rank would load and run."""
    target, marker = _plant(tmp_path / "cache", tmp_path, monkeypatch)
    target.parent.chmod(0o777)
    _refused(marker, r"did not load its TensorFlow status op: '.*tf_ops' is not safe to load "
                     r"code from: it must be a directory .* mode 777")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_library_owned_by_another_user_is_not_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target, marker = _plant(tmp_path / "cache", tmp_path, monkeypatch)
    os.chown(target, 65534, 65534)
    _refused(marker, r"status_op-.*\.so' is not safe to load code from: it must be a regular "
                     r"file .* owner uid 65534")


def test_a_library_others_may_write_or_a_link_is_not_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target, marker = _plant(tmp_path / "cache", tmp_path, monkeypatch)
    target.chmod(0o777)
    _refused(marker, r"status_op-.*\.so' is not safe to load code from: .* mode 777")
    elsewhere = target.rename(tmp_path / "elsewhere.so")
    elsewhere.chmod(0o755)
    target.symlink_to(elsewhere)
    _refused(marker, r"status_op-.*\.so' is a symbolic link")
