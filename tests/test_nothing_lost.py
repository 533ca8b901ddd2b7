"""Nothing lost, nothing corrupted, nothing trusted blindly: each defect of the adversarial
review, reproduced. A value that does not fit is refused rather than wrapped; a target the
runtime cannot write into is refused rather than left empty; a file is replaced whole or not at
all; a model reads external data only from its own folder; a model file is sized before it is
read."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart_kit as pk
import popart_kit.popart as popart

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

INFERENCE = pk.SessionConfig(mode="inference", batches_per_step=1)


def _integer_model(dtype: str, weight: np.ndarray) -> tuple[bytes, str, str]:
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo(dtype, list(weight.shape)))
    w = b.addInitializedInputTensor(weight)
    y = b.aiOnnx.add([x, w])
    return b.getModelProto(), w, y


# -- 64-bit integer weights ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype, values", [
    ("INT64", [2**40 + 5, -(2**35)]),
    ("INT64", [2**31, 0]),
    ("UINT64", [2**63, 1]),
])
def test_64_bit_weights_that_would_wrap_are_refused_with_the_model(dtype, values):
    model, w, y = _integer_model(dtype, np.array(values, dtype.lower()))
    with pytest.raises(pk.InvalidModel) as info:
        pk.InferenceSession(model, INFERENCE, anchors={y: "All"}, backend="xla")
    assert "K-int64-range" in info.value.rules
    assert str(values[0]) in str(info.value) and w in str(info.value)


def test_64_bit_weights_written_to_a_session_are_range_checked():
    start = np.array([5, -3], np.int64)
    model, w, y = _integer_model("INT64", start)
    session = pk.InferenceSession(model, INFERENCE, anchors={y: "All"}, backend="xla")
    with pytest.raises(pk.InvalidData) as info:
        session.write_weights({w: np.array([2**40 + 5, -(2**35)], np.int64)})
    assert "K-int64-range" in info.value.rules and "1099511627781" in str(info.value)
    np.testing.assert_array_equal(session.weights()[w], start)  # nothing half-written


def test_64_bit_weights_within_range_round_trip_exactly():
    limits = np.iinfo(np.int32)
    values = np.array([limits.max, limits.min], np.int64)
    model, w, y = _integer_model("INT64", values)
    session = pk.InferenceSession(model, INFERENCE, anchors={y: "All"}, backend="xla")
    assert session.weights()[w].dtype == np.int64
    np.testing.assert_array_equal(session.weights()[w], values)
    stored = {t.name: numpy_helper.to_array(t) for t in session.model_proto().graph.initializer}
    np.testing.assert_array_equal(stored[w], values)


# -- targets the drop-in cannot write into ------------------------------------------------------

def _scale_session():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    y = b.aiOnnx.mul([x, w])
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.weightsFromHost()
    return session, w, y


@pytest.mark.parametrize("target", [
    np.zeros((2, 3), np.float32, order="F"),
    np.zeros((2, 6), np.float32)[:, ::2],
])
def test_read_weights_into_a_non_contiguous_array_is_refused(target):
    session, w, _ = _scale_session()
    with pytest.raises(popart.popart_exception, match="c-contiguous"):
        session.readWeights(popart.PyWeightsIO({w: target}))


def test_read_weights_into_a_read_only_array_is_refused():
    session, w, _ = _scale_session()
    target = np.zeros((2, 3), np.float32)
    target.flags.writeable = False
    with pytest.raises(popart.popart_exception, match="read-only"):
        session.readWeights(popart.PyWeightsIO({w: target}))


def test_read_weights_into_a_contiguous_array_is_filled():
    session, w, _ = _scale_session()
    target = np.zeros((3, 2), np.float32)  # PopART checks element counts only
    session.readWeights(popart.PyWeightsIO({w: target}))
    np.testing.assert_array_equal(target.ravel(), np.arange(6, dtype=np.float32))


def test_a_non_contiguous_callback_output_buffer_is_refused():
    session, _, _ = _scale_session()
    buffers = []

    def output(name):
        buffers.append(np.zeros((3, 2), np.float32).T)  # Fortran-ordered (2, 3)
        return buffers[-1]

    stepio = popart.PyStepIOCallback(lambda name, prefetch: np.ones((2, 3), np.float32),
                                     lambda name: None, output, lambda name: None)
    with pytest.raises(popart.popart_exception, match="c-contiguous"):
        session.run(stepio)


# -- files replaced whole or not at all ---------------------------------------------------------

_FULL_DISK = """
import resource, signal, sys
import numpy as np, onnx
import popart_kit as pk, popart_kit.popart as popart

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
folder = sys.argv[1]
b = popart.Builder()
x = b.addInputTensor(popart.TensorInfo("FLOAT", [64]), "x")
w = b.addInitializedInputTensor(np.ones(64, np.float32))
y = b.aiOnnx.mul([x, w])
session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                  popart.DeviceManager().createCpuDevice())
session.prepareDevice()
session.modelToHost(folder + "/ckpt.onnx")
b.saveModelProto(folder + "/model.onnx")
cfg = pk.SessionConfig(mode="inference", batches_per_step=4)
cfg.to_file(folder + "/config.toml")
before = {n: open(f"{folder}/{n}", "rb").read() for n in ("ckpt.onnx", "model.onnx",
                                                          "config.toml")}
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (32, hard))  # a disk that takes 32 bytes a file
failures = []
for name, write in [("ckpt.onnx", lambda p: session.modelToHost(p)),
                    ("model.onnx", lambda p: b.saveModelProto(p)),
                    ("config.toml", lambda p: cfg.model_copy(update={"batches_per_step": 8})
                                                 .to_file(p))]:
    try:
        write(f"{folder}/{name}")
    except Exception as err:
        failures.append((name, type(err).__name__, isinstance(err, ValueError), str(err)))
    else:
        failures.append((name, "no error", False, ""))
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
for name, kind, is_value_error, text in failures:
    print(name, kind, is_value_error, name in text)
for name, data in before.items():
    print(name, "unchanged" if open(f"{folder}/{name}", "rb").read() == data else "CHANGED")
onnx.load(folder + "/ckpt.onnx")
print(pk.SessionConfig.from_file(folder + "/config.toml").batches_per_step)
print(sorted(p for p in __import__("os").listdir(folder) if p.endswith(".tmp")))
"""


def test_writers_leave_the_old_file_whole_when_the_disk_is_full(tmp_path):
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[:3] == ["ckpt.onnx popart_exception True True",
                         "model.onnx FileWriteError True True",
                         "config.toml FileWriteError True True"]
    assert lines[3:6] == [f"{n} unchanged" for n in ("ckpt.onnx", "model.onnx", "config.toml")]
    assert lines[6:] == ["4", "[]"]  # the old config loads; no temporary file is left


def test_file_write_error_is_an_os_error_and_names_the_file(tmp_path):
    folder = tmp_path / "config.toml"
    folder.mkdir()
    with pytest.raises(pk.FileWriteError) as info:
        INFERENCE.to_file(folder)
    assert isinstance(info.value, OSError) and isinstance(info.value, pk.PopartKitError)
    assert "config.toml" in str(info.value) and "directory" in str(info.value)


def test_an_atomic_write_keeps_the_permissions_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "config.json"
    INFERENCE.to_file(path)
    os.chmod(path, 0o600)
    INFERENCE.model_copy(update={"batches_per_step": 3}).to_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert pk.SessionConfig.from_file(path).batches_per_step == 3


# -- external data and the size of model files --------------------------------------------------

def _external_model(location: str) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    entry = w.external_data.add()
    entry.key, entry.value = "location", location
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    return helper.make_model(graph)


@pytest.mark.parametrize("given", ["proto", "bytes"])
def test_external_data_of_a_model_without_a_folder_is_refused(tmp_path, monkeypatch, given):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (tmp_path / "w.bin").symlink_to(secret)
    monkeypatch.chdir(tmp_path)  # where onnx would look for it
    model = _external_model("w.bin")
    model = model if given == "proto" else model.SerializeToString()
    with pytest.raises(pk.ModelError) as info:
        pk.InferenceSession(model, INFERENCE, anchors={"y": "All"}, backend="xla")
    assert info.value.rule == "K-model-external-data" and "'w'" in str(info.value)
    with pytest.raises(popart.popart_exception, match="external"):
        popart.InferenceSession(model, popart.DataFlow(1, ["y"]),
                                popart.DeviceManager().createCpuDevice())


def test_external_data_beside_a_model_file_is_read(tmp_path):
    (tmp_path / "w.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    onnx.save(_external_model("w.bin"), tmp_path / "m.onnx")
    session = pk.InferenceSession(tmp_path / "m.onnx", INFERENCE, anchors={"y": "All"},
                                  backend="xla")
    np.testing.assert_array_equal(session.weights()["w"], np.arange(4, dtype=np.float32))


def test_external_data_through_a_link_out_of_the_model_folder_is_refused(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.bin").symlink_to(outside)
    onnx.save(_external_model("w.bin"), folder / "m.onnx")
    with pytest.raises(pk.ModelError):
        pk.InferenceSession(folder / "m.onnx", INFERENCE, anchors={"y": "All"}, backend="xla")


@pytest.mark.parametrize("make", ["device", "fifo", "huge"])
def test_model_files_are_checked_before_they_are_read(tmp_path, make):
    path = tmp_path / "model.onnx"
    if make == "device":
        path = "/dev/zero"
    elif make == "fifo":
        os.mkfifo(path)  # reading it would block until a writer comes: one comes in 10 s
        threading.Thread(target=_unblock, args=(path, 10.0), daemon=True).start()
    else:
        with open(path, "wb") as f:
            f.truncate(2**31)  # sparse: no disk used
    start = time.perf_counter()
    with pytest.raises(pk.ModelError) as info:
        pk.PipelineLayout.from_model(path)
    assert time.perf_counter() - start < 5
    assert info.value.rule == "K-model-file"
    assert ("regular file" if make != "huge" else "2147483647") in str(info.value)


def _unblock(fifo, after: float) -> None:
    """Open and close ``fifo`` for writing after a while, so a reader blocked on it ends."""
    time.sleep(after)
    with contextlib.suppress(OSError):  # no reader: nothing to unblock
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_the_cli_check_refuses_a_device_quickly():
    done = subprocess.run([sys.executable, "-m", "popart_kit.cli", "check", "/dev/zero"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "regular file" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
